"""ESM C as an extraction model: the network against EvolutionaryScale's own code, the
tokenizer, the loader's checks, and extraction through the pipeline and Snakemake.

The referee is EvolutionaryScale's ``esm`` package (3.1.x). It cannot be installed beside
torch 2.13 and transformers 5 (it pins transformers<4.48.2, torchtext, biotite==0.41.2),
so its pure-Python files are unpacked from the wheel into a temporary folder and
imported there, the imports ESM C never runs (zstd, cloudpathlib, the SDK, structure
encoding) stubbed. Point ``AMPFLOW_ESM_REFERENCE`` at a folder holding the wheels::

    pip download "esm==3.1.6" einops --no-deps -d /some/dir
    AMPFLOW_ESM_REFERENCE=/some/dir pytest tests/test_extract_esmc.py

Without it those tests are skipped; the others (vocabulary and key names as listed in
the reference's source, padding and batch invariance, the loader's errors, the
pipeline) always run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
import zipfile
from collections import Counter
from pathlib import Path

import anndata as ad
import numpy as np
import pytest
import torch
from conftest import workflow_copy
from extract_doubles import InlinePool, out_of_memory_above, pool_class
from extract_helpers import random_fasta

from ampflow.base.errors import InputError
from ampflow.extract.config import ExtractSettings, ModelSpec
from ampflow.extract.esmc import EsmcConfig, EsmcTokenizer, apply_rotary, read_config, rotary_tables, weights_file
from ampflow.extract.models import load_embedder, model_shape, resolve_source
from ampflow.extract.run import extract_fasta
from ampflow.extract.tiny import ESMC_WEIGHTS, randomise_norms_, write_esmc
from ampflow.extract.weights import load_model

BIN = Path(sys.executable).parent

# esm/utils/constants/esm3.py SEQUENCE_VOCAB, as published (ids are the positions)
REFERENCE_VOCAB = "<cls> <pad> <eos> <unk> L A G V S E R T I D P K Q N F Y M H W C X B U Z O . - | <mask>".split()


def reference_keys(n_layers: int) -> list[str]:
    """The state-dict keys of esm.models.esmc.ESMC, read off its source: embed, the
    TransformerStack's blocks (UnifiedTransformerBlock: MultiHeadAttention with qk
    LayerNorms, swiglu_ln_ffn, no biases but the LayerNorms'), the stack's bias-free norm,
    RegressionHead(d_model, 64)."""
    block = [
        "attn.layernorm_qkv.0.weight", "attn.layernorm_qkv.0.bias", "attn.layernorm_qkv.1.weight",
        "attn.out_proj.weight", "attn.q_ln.weight", "attn.k_ln.weight",
        "ffn.0.weight", "ffn.0.bias", "ffn.1.weight", "ffn.3.weight",
    ]  # fmt: skip
    head = [f"sequence_head.{i}.{p}" for i in (0, 2, 3) for p in ("weight", "bias")]
    return ["embed.weight", *(f"transformer.blocks.{i}.{k}" for i in range(n_layers) for k in block), "transformer.norm.weight", *head]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_esmc(tmp_path_factory.mktemp("models") / "esmc", seed=0)


# ------------------------------------------------------------------ the referee
def _unpack(wheels: list[Path], dest: Path) -> None:
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            for name in z.namelist():
                if name.endswith(".py"):
                    z.extract(name, dest)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """EvolutionaryScale's ``ESMC`` class and sequence tokenizer, imported from the
    wheel's files in isolation (see the module docstring)."""
    given = os.environ.get("AMPFLOW_ESM_REFERENCE", "")
    paths = [Path(p) for p in given.split(os.pathsep) if p]
    wheels = [w for p in paths for w in (sorted(p.glob("*.whl")) if p.is_dir() else [p]) if w.is_file()]
    if not any(w.name.startswith("esm-") for w in wheels):
        pytest.skip("set AMPFLOW_ESM_REFERENCE to a folder with the esm 3.1.x (and einops) wheels: pip download 'esm==3.1.6' einops --no-deps -d DIR")
    src = tmp_path_factory.mktemp("esm_reference")
    _unpack(wheels, src)
    if not (src / "einops").is_dir():
        pytest.importorskip("einops", reason="the reference needs einops (its wheel beside esm's, or installed)")
    before = set(sys.modules)

    def stub(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        mp.setitem(sys.modules, name, m)
        return m

    class Anything:
        def __init__(self, *args, **kwargs):
            pass

    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(src))
        # optional imports of modules ESM C's forward pass never calls
        stub("zstd")
        stub("cloudpathlib", CloudPath=Anything)
        import esm  # the wheel's

        assert Path(esm.__file__).is_relative_to(src), esm.__file__
        # the tokenization package's __init__ imports the structure/function tokenizers
        # (biotite ...): the sequence tokenizer alone, under a bare package
        tok = stub("esm.tokenization")
        tok.__path__ = [str(src / "esm" / "tokenization")]
        from esm.tokenization.sequence_tokenizer import EsmSequenceTokenizer

        tok.EsmSequenceTokenizer = EsmSequenceTokenizer
        stub("esm.sdk")
        api = {n: Anything for n in ("ESMProtein", "ESMProteinTensor", "ForwardTrackData", "LogitsConfig", "LogitsOutput")}
        stub("esm.sdk.api", ESMCInferenceClient=type("ESMCInferenceClient", (), {}), **api)
        stub("esm.utils.encoding")
        stub("esm.utils.decoding", decode_sequence=None)
        stub("esm.utils.sampling", _BatchedESMProteinTensor=Anything)
        from esm.models.esmc import ESMC

        yield types.SimpleNamespace(ESMC=ESMC, tokenizer=EsmSequenceTokenizer())
        for name in set(sys.modules) - before:
            if name == "esm" or name.startswith(("esm.", "einops")):
                del sys.modules[name]


def reference_model(reference, d_model: int, n_heads: int, n_layers: int, seed: int):
    """The reference network with random weights, its LayerNorms random too."""
    torch.manual_seed(seed)
    model = randomise_norms_(reference.ESMC(d_model, n_heads, n_layers, reference.tokenizer, use_flash_attn=False).eval())
    assert not model._use_flash_attn
    return model


SEQS = ["MKTAYIAKQRQISFVKSHFSRQ", "MKV", "ACDEFGHIKLMNPQRSTVWYXBUZO", "GGGGSGGGGS", "W"]


def padded(tokenizer_encode, seqs) -> torch.Tensor:
    ids = [tokenizer_encode(s) for s in seqs]
    out = torch.full((len(ids), max(map(len, ids))), REFERENCE_VOCAB.index("<pad>"), dtype=torch.long)
    for i, t in enumerate(ids):
        out[i, : len(t)] = torch.tensor(t)
    return out


def test_tokenizer_equals_the_reference(reference):
    ours = EsmcTokenizer()
    assert ours.get_vocab() == reference.tokenizer.get_vocab()
    for s in [*SEQS, "MKTJ", "mkt", "A|B.-*"]:
        assert ours.encode(s) == reference.tokenizer.encode(s, add_special_tokens=True), s
    for name in ("cls", "pad", "eos", "unk", "mask"):
        assert getattr(ours, f"{name}_token_id") == getattr(reference.tokenizer, f"{name}_token_id"), name


def test_network_equals_the_reference(reference, tmp_path):
    """The reference ESMC's random weights, saved as EvolutionaryScale saves theirs,
    read by our loader: every hidden state equal to 1e-5 in float32 (padded batch),
    also under bfloat16 autocast (to bfloat16 precision), and the Embedder's pooled
    vectors equal to the reference's output pooled by hand."""
    ref = reference_model(reference, d_model=48, n_heads=3, n_layers=3, seed=1)
    (tmp_path / "data/weights").mkdir(parents=True)
    torch.save(ref.state_dict(), tmp_path / "data/weights/esmc_test.pth")
    # not a published width: the heads in config.json, the rest from the weights
    (tmp_path / "config.json").write_text('{"n_heads": 3}')
    assert read_config(tmp_path) == EsmcConfig(48, 3, 3)
    ours = load_model("esmc", tmp_path)

    ids = padded(reference.tokenizer.encode, SEQS)
    real = ids != reference.tokenizer.pad_token_id
    with torch.inference_mode():
        out = ref(sequence_tokens=ids)
        embedded = ref.embed(ids)
        got = ours.hidden_states(ids, real.long(), [0, 1, 2, 3])
    want = {0: embedded, 1: out.hidden_states[0], 2: out.hidden_states[1], 3: out.embeddings}
    for layer in want:
        err = (got[layer] - want[layer])[real].abs().max().item()
        assert err <= 1e-5, (layer, err)
    # the reference's last hidden state is before the final norm; ours after it
    assert not torch.allclose(got[3], out.hidden_states[2])

    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        out16 = ref(sequence_tokens=ids)
        got16 = ours.hidden_states(ids, real.long(), [3])[3]
    assert got16.dtype == out16.embeddings.dtype
    assert (got16.float() - out16.embeddings.float())[real].abs().max() <= 1e-2 * out16.embeddings.float().abs().max()

    # padded batches, and packed ones (sequences one after another, no mask)
    for pack in (False, True):
        spec = ModelSpec(kind="esmc", source=str(tmp_path), layer=[-1, 1, 0], pooling=["mean", "bos", "mean_special"], per_token=True, pack=pack)
        emb = load_embedder(spec, tmp_path, [3, 1, 0])
        vectors, stats = emb.embed(SEQS)
        assert not pack or (stats["attention"] == "segments" and stats["batches"] < len(SEQS))
        check_pooled(vectors, want)


def check_pooled(vectors: dict, want: dict) -> None:
    for i, s in enumerate(SEQS):
        n = len(s)
        for layer in (3, 1, 0):
            h = want[layer][i]
            np.testing.assert_allclose(vectors[f"L{layer}.mean"][i], h[1 : n + 1].mean(0).numpy(), atol=1e-5, rtol=0)
            np.testing.assert_allclose(vectors[f"L{layer}.mean_special"][i], h[: n + 2].mean(0).numpy(), atol=1e-5, rtol=0)
            np.testing.assert_allclose(vectors[f"L{layer}.bos"][i], h[0].numpy(), atol=1e-5, rtol=0)
            np.testing.assert_allclose(vectors[f"L{layer}.tokens"][i], h[1 : n + 1].numpy(), atol=1e-5, rtol=0)


def test_tiny_checkpoint_loads_into_the_reference(reference, tiny):
    """The tiny model's file holds exactly the reference's keys and shapes (strict
    load), and both networks give the same last hidden state."""
    cfg = read_config(tiny)
    ref = reference.ESMC(cfg.d_model, cfg.n_heads, cfg.n_layers, reference.tokenizer, use_flash_attn=False).eval()
    ref.load_state_dict(torch.load(tiny / ESMC_WEIGHTS, weights_only=True), strict=True)
    ids = padded(reference.tokenizer.encode, SEQS)
    with torch.inference_mode():
        want = ref(sequence_tokens=ids).embeddings
        got = load_model("esmc", tiny).hidden_states(ids, (ids != 1).long(), [cfg.n_layers])[cfg.n_layers]
    real = ids != 1
    assert (got - want)[real].abs().max() <= 1e-5


# ------------------------------------------------------------------ without the referee
def test_vocabulary_and_key_names_as_in_the_reference_source(tiny):
    tok = EsmcTokenizer()
    assert tok.get_vocab() == {t: i for i, t in enumerate(REFERENCE_VOCAB)}
    assert (tok.cls_token_id, tok.pad_token_id, tok.eos_token_id, tok.unk_token_id, tok.mask_token_id) == (0, 1, 2, 3, 32)
    # one id per letter, <cls> ... <eos>; letters outside the vocabulary (J, lower case) -> <unk>
    assert tok.encode("MKJa") == [0, 20, 15, 3, 3, 2]
    emb = load_embedder(ModelSpec(kind="esmc", tiny=True), tiny, [2])
    assert emb.tokenize(["MKJa"])[0].ids == tok.encode("MKJa")
    assert emb.tokenize(["MKJa"])[0].own == [False, True, True, True, True, False]
    state = torch.load(tiny / ESMC_WEIGHTS, weights_only=True)
    assert list(state) == reference_keys(2)
    assert state["embed.weight"].shape == (64, 32)
    assert state["transformer.blocks.0.ffn.1.weight"].shape == (2 * 256, 32)  # 8/3 x 32 rounded up to 256
    assert json.loads((tiny / "config.json").read_text()) == {"d_model": 32, "n_heads": 4, "n_layers": 2}


def test_published_shapes_from_the_hub_layout(tmp_path):
    """A hub snapshot (config.json holding {}, the weights under data/weights/): the shape
    from the weights and the published head counts; the file itself as the source."""
    for name, (d, heads, layers) in {"300m": (960, 15, 30), "600m": (1152, 18, 36)}.items():
        folder = tmp_path / name
        (folder / "data/weights").mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        # shapes that matter to the reading only: the embedding and the last block's index
        state = {"embed.weight": torch.zeros(64, d), f"transformer.blocks.{layers - 1}.attn.out_proj.weight": torch.zeros(1)}
        torch.save(state, folder / f"data/weights/esmc_{name}_2024_12_v0.pth")
        assert read_config(folder) == EsmcConfig(d, heads, layers)
        pth = weights_file(folder)
        assert pth.name == f"esmc_{name}_2024_12_v0.pth"
        assert resolve_source(str(pth), "esmc") == pth and model_shape(pth, "esmc") == (layers, d)
    with pytest.raises(InputError, match="a file; a esm2 model is a folder"):
        resolve_source(str(pth), "esm2")


def test_loader_errors_name_the_file_and_key(tiny, tmp_path):
    state = torch.load(tiny / ESMC_WEIGHTS, weights_only=True)

    def folder_with(name, st, config=None):
        f = tmp_path / name
        (f / "data/weights").mkdir(parents=True)
        torch.save(st, f / "data/weights/w.pth")
        (f / "config.json").write_text(json.dumps(config if config is not None else {"d_model": 32, "n_heads": 4, "n_layers": 2}))
        return f

    missing = folder_with("missing", {k: v for k, v in state.items() if k != "transformer.blocks.1.attn.q_ln.weight"})
    with pytest.raises(InputError, match=r"w\.pth: checkpoint does not match the esmc network: missing \['transformer\.blocks\.1\.attn\.q_ln\.weight'\]"):
        load_model("esmc", missing)
    extra = folder_with("extra", {**state, "transformer.blocks.0.attn.rotary.inv_freq": torch.ones(4)})
    with pytest.raises(InputError, match=r"unexpected \['transformer\.blocks\.0\.attn\.rotary\.inv_freq'\]"):
        load_model("esmc", extra)
    bad = dict(state)
    bad["transformer.blocks.0.attn.out_proj.weight"] = torch.zeros(32, 31)
    wrong = folder_with("wrong", bad)
    with pytest.raises(
        InputError, match=r"w\.pth: checkpoint tensor transformer\.blocks\.0\.attn\.out_proj\.weight has shape \(32, 31\), the network \(32, 32\)"
    ):
        load_model("esmc", wrong)
    deeper = folder_with("deeper", state, {"n_heads": 4, "n_layers": 3})  # config and weights disagree
    with pytest.raises(InputError, match=r"missing \['transformer\.blocks\.2\."):
        load_model("esmc", deeper)
    odd = folder_with("odd", state, {})  # width 32 is not published: the heads must be said
    with pytest.raises(InputError, match=r"w\.pth: an ESM C of width 32 is not a published one .*n_heads"):
        read_config(odd)
    (odd / "data/weights/other.pth").write_bytes(b"")
    with pytest.raises(InputError, match=r"several weight files in the folder \(data/weights/other\.pth, data/weights/w\.pth\)"):
        weights_file(odd)
    with pytest.raises(InputError, match=r"other\.pth: cannot read the weights"):
        load_model("esmc", odd / "data/weights/other.pth")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no ESM C weights in the folder"):
        load_model("esmc", tmp_path / "empty")


def test_padding_batch_and_cut_invariance(tiny):
    """A sequence's states do not depend on its batch (padding, order) and a network cut
    after block k gives the whole network's state k."""
    model = load_model("esmc", tiny)
    tok = EsmcTokenizer()
    ids = padded(tok.encode, SEQS)
    with torch.inference_mode():
        batch = model.hidden_states(ids, (ids != 1).long(), [0, 1, 2])
        perm = [3, 0, 4, 2, 1]
        shuffled = model.hidden_states(ids[perm], (ids[perm] != 1).long(), [2])[2]
        cut = load_model("esmc", tiny, n_blocks=1)
        assert cut.transformer.norm is None and len(cut.transformer.blocks) == 1
        cut1 = cut.hidden_states(ids, (ids != 1).long(), [1])[1]
        for i, s in enumerate(SEQS):
            one = torch.tensor([tok.encode(s)])
            alone = model.hidden_states(one, torch.ones_like(one), [0, 1, 2])
            n = one.shape[1]
            for layer in (0, 1, 2):
                torch.testing.assert_close(batch[layer][i, :n], alone[layer][0], atol=1e-5, rtol=0)
            torch.testing.assert_close(shuffled[perm.index(i), :n], alone[2][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(cut1, batch[1], atol=0, rtol=0)


def test_rotary_depends_on_relative_positions_only():
    """q.k after the rotation is a function of the positions' difference (and the
    rotation keeps norms)."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 16)
    cos, sin = rotary_tables(64, 16, "cpu", torch.float64)
    q, k = q.double(), k.double()

    def rot(x, pos):
        return apply_rotary(x.expand(64, 1, 16)[None], cos, sin)[0, pos, 0]

    for m, n, shift in [(3, 10, 7), (0, 5, 40), (20, 2, 30)]:
        assert torch.allclose(rot(q, m) @ rot(k, n), rot(q, m + shift) @ rot(k, n + shift), atol=1e-12)
    assert torch.allclose(rot(q, 17).norm(), q.norm())
    assert not torch.allclose(rot(q, 3) @ rot(k, 10), rot(q, 3) @ rot(k, 11))


# ------------------------------------------------------------------ the pipeline
def run(tmp_path, fasta, spec, folder=None, tag="run", pool=None, oom_above=None, **settings):
    out = tmp_path / tag
    s = ExtractSettings.from_dict({"sequences_per_file": 8, "cpu_workers": 2, "fasta": {"too_long": "window"}, **settings})
    with pool_class(pool), pytest.MonkeyPatch.context() as m:
        if oom_above is not None:
            out_of_memory_above(oom_above, m.setattr)
        job = extract_fasta(
            fasta, spec, "esmc_tiny", out / "work", out / "x.h5ad", out / "report.tsv", out / "telemetry.jsonl",
            out / "progress.jsonl", settings=s, windows=out / "w.h5ad", tokens=out / "t.h5" if spec.per_token else None, model_folder=folder,
        )  # fmt: skip
    return job, out


def read_fasta(path: Path) -> list[str]:
    return ["".join(r.splitlines()[1:]) for r in path.read_text().split(">")[1:]]


def test_extraction_through_the_pipeline(tiny, tmp_path):
    """The tiny ESM C given by its weights file as the source, through worker processes
    and the cache (.done markers), with windows and per-token vectors: the vectors of
    the model run one sequence at a time; a re-run computes nothing; batches that run
    out of memory are split and give the same vectors."""
    fasta = random_fasta(tmp_path / "p.fa", "esm2", 24, seed=3, lengths=(5, 120))
    seqs = read_fasta(fasta)
    spec = ModelSpec(kind="esmc", source=str(tiny / ESMC_WEIGHTS), layer=[-1, 1], per_token=True, max_length=100)
    job, out = run(tmp_path, fasta, spec)
    assert job["model"]["kind"] == "esmc" and job["layers"] == [2, 1] and job["n_layers"] == 2 and job["dim"] == 32
    assert job["run"]["cached"] == 0 and job["run"]["computed"] > 24  # records, plus windows of the long ones
    x = ad.read_h5ad(out / "x.h5ad")
    assert x.shape == (24, 32) and x.X.dtype == np.float32 and sorted(x.obsm) == ["L1.mean", "L2.mean"]
    np.testing.assert_array_equal(x.obsm["L2.mean"], x.X)
    assert x.uns["extract"]["model"]["kind"] == "esmc" and list(x.uns["extract"]["poolings"]) == ["mean"]
    long_ones = [i for i, s in enumerate(seqs) if len(s) > 100]
    assert long_ones and ad.read_h5ad(out / "w.h5ad").n_obs > 24 and (out / "t.h5").is_file()
    (cache,) = (out / "work" / "cache").iterdir()
    marks = [json.loads(p.read_text()) for p in sorted((cache / "shards").glob("*.done"))]
    assert len(marks) > 1 and sum(len(m["keys"]) for m in marks) == job["run"]["computed"]

    emb = load_embedder(spec, tiny, [2, 1])
    short = [i for i, s in enumerate(seqs) if len(s) <= 100]
    alone = np.stack([emb.embed_batch(emb.tokenize([seqs[i]]))["L2.mean"][0] for i in short])
    np.testing.assert_allclose(x.X[short], alone, atol=1e-5, rtol=0)

    again, _ = run(tmp_path, fasta, spec)
    assert again["run"]["computed"] == 0 and again["run"]["cached"] == job["run"]["computed"]
    np.testing.assert_array_equal(ad.read_h5ad(out / "x.h5ad").X, x.X)

    # short near-equal sequences share CPU batches (8 x 32 tokens); over 100 padded
    # tokens a batch "runs out of memory" and is halved down to 3 sequences
    short_fa = random_fasta(tmp_path / "short.fa", "esm2", 16, seed=4, lengths=(29, 30))
    tiny_spec = ModelSpec(kind="esmc", tiny=True, layer=[-1, 1])
    oom, out3 = run(tmp_path, short_fa, tiny_spec, folder=tiny, tag="oom", pool=InlinePool, cpu_workers=1, oom_above=100)
    assert sum(w.get("splits", 0) for w in oom["run"]["workers"]) > 0
    alone = np.stack([emb.embed_batch(emb.tokenize([s]))["L2.mean"][0] for s in read_fasta(short_fa)])
    np.testing.assert_allclose(ad.read_h5ad(out3 / "x.h5ad").X, alone, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_extraction_only_config_with_esmc_runs_through_snakemake(tmp_path):
    """An extraction-only config with a tiny ESM C: the workflow builds it, one extract
    job, one output job per input."""
    root = workflow_copy(tmp_path / "wf")
    random_fasta(root / "a.fa", "esm2", 12, seed=1, lengths=(10, 60))
    (root / "config/only.yaml").write_text(
        "dataset: prot\n"
        "extract:\n"
        "  inputs:\n"
        "    a: {fasta: a.fa, models: [esmc]}\n"
        "  models:\n"
        "    esmc: {kind: esmc, tiny: true, layer: [-1, 0], pooling: [mean, bos]}\n"
        "  cpu_workers: 1\n"
    )
    cmd = [str(BIN / "snakemake"), "--cores", "2", "--profile", "profiles/local", "--configfile", "config/only.yaml"]
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = Counter(ln.split()[1].rstrip(":") for ln in r.stderr.splitlines() if ln.startswith(("rule ", "localrule ")))
    assert jobs["tiny_model"] == 1 and jobs["extract"] == 1 and jobs["extract_outputs"] == 1, dict(jobs)
    assert (root / "resources/models/esmc" / ESMC_WEIGHTS).is_file()
    a = ad.read_h5ad(root / "results/prot/extract/a.esmc.h5ad")
    assert a.shape == (12, 32) and sorted(a.obsm) == ["L0.bos", "L0.mean", "L2.bos", "L2.mean"]
    assert a.uns["extract"]["model"]["kind"] == "esmc"
