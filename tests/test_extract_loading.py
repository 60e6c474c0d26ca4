"""Streaming model loading (ampflow.extract.weights): same networks, less host memory.

Referees are independent of the loader: transformers' ``from_pretrained`` for ESM-2, and
for DNABERT-S the network built whole and filled with ``load_state_dict`` from
safetensors' ``load_file`` / ``torch.load``. The slow tests spawn worker processes as the
extraction pool does and sample their memory from /proc.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ampflow.base.errors import InputError
from ampflow.extract.dnabert import DnabertConfig, DnabertModel
from ampflow.extract.tiny import ESM2_650M, esm2_model, write_dnabert_s, write_esm2
from ampflow.extract.weights import load_lock, load_model

ESM_IDS = torch.tensor([[0, 20, 15, 11, 5, 23, 12, 5, 15, 16, 2, 1, 1], [0, 8, 9, 10, 2, 1, 1, 1, 1, 1, 1, 1, 1]])
ESM_MASK = (ESM_IDS != 1).long()
DNA_IDS = torch.tensor([[1, 7, 9, 11, 40, 2, 3], [1, 12, 2, 3, 3, 3, 3]])
DNA_MASK = (DNA_IDS != 3).long()
LAYERS = 3


@pytest.fixture(scope="module")
def esm_folder(tmp_path_factory) -> Path:
    return write_esm2(tmp_path_factory.mktemp("esm") / "esm2", seed=1, layers=LAYERS)


@pytest.fixture(scope="module")
def dna_folder(tmp_path_factory) -> Path:
    return write_dnabert_s(tmp_path_factory.mktemp("dna") / "dnabert", seed=1, layers=LAYERS)


def esm_reference(folder):
    """transformers' own loading: hidden_states[i] is the output after i blocks (the last
    one after the final layer norm)."""
    from transformers import EsmModel

    ref = EsmModel.from_pretrained(str(folder), local_files_only=True, add_pooling_layer=False).eval()
    with torch.no_grad():
        return ref(input_ids=ESM_IDS, attention_mask=ESM_MASK, output_hidden_states=True).hidden_states


def esm_out(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ESM_IDS, attention_mask=ESM_MASK).last_hidden_state


def dnabert_reference(folder, state: dict | None = None) -> DnabertModel:
    """The network built whole (random init), then the checkpoint loaded over it."""
    model = DnabertModel(DnabertConfig.from_json(folder / "config.json"))
    model.load_state_dict(state if state is not None else load_file(folder / "model.safetensors"))
    return model.eval()


def copy_folder(src: Path, dst: Path, skip=("model.safetensors",)) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in skip:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


# ------------------------------------------------------------------ ESM-2
@pytest.mark.parametrize("n_blocks", [None, 0, 1, 2, LAYERS, LAYERS + 5])
def test_esm2_equals_from_pretrained(esm_folder, n_blocks):
    """Full model and cut ones (n_blocks < layers: no final layer norm, as hidden_states)."""
    want = esm_reference(esm_folder)
    model = load_model("esm2", esm_folder, n_blocks=n_blocks)
    blocks = LAYERS if n_blocks is None else min(n_blocks, LAYERS)
    assert len(model.encoder.layer) == blocks
    assert (model.encoder.emb_layer_norm_after is None) == (blocks < LAYERS)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    torch.testing.assert_close(esm_out(model), want[blocks], atol=1e-6, rtol=0)


def test_esm2_blocks_past_the_cut_are_not_read(esm_folder, tmp_path):
    """With n_blocks, the later blocks' tensors are never looked at (here: wrong shapes)."""
    alt = copy_folder(esm_folder, tmp_path / "bad_tail")
    sd = load_file(esm_folder / "model.safetensors")
    sd[f"encoder.layer.{LAYERS - 1}.intermediate.dense.weight"] = torch.zeros(3, 3)
    save_file(sd, alt / "model.safetensors")
    torch.testing.assert_close(esm_out(load_model("esm2", alt, n_blocks=1)), esm_reference(esm_folder)[1], atol=1e-6, rtol=0)
    with pytest.raises(InputError, match="shape"):
        load_model("esm2", alt)


def test_esm2_hub_style_masked_lm_folder(tmp_path):
    """EsmForMaskedLM folders (esm. prefix, lm_head, contact_head), as transformers 5
    writes them (LayerNorm gamma/beta, one inv_freq under a literal '*') and as older
    hub checkpoints do (LayerNorm weight/bias, inv_freq per layer, here rounded to fp16
    as a half-precision checkpoint has it: taken as is, like transformers does)."""
    from transformers import EsmForMaskedLM

    torch.manual_seed(3)
    lm = EsmForMaskedLM(esm2_model(0, layers=LAYERS).config).eval()
    new = tmp_path / "lm5"
    lm.save_pretrained(new)
    keys = safe_open(str(new / "model.safetensors"), "pt").keys()
    assert any(k.startswith("lm_head.") for k in keys) and any(k.startswith("esm.contact_head.") for k in keys)

    old = tmp_path / "lm4"
    old.mkdir()
    (old / "config.json").write_text((new / "config.json").read_text())
    sd = {}
    for k, v in load_file(new / "model.safetensors").items():
        if k.endswith("rotary_embeddings.inv_freq"):
            for i in range(LAYERS):
                sd[f"esm.encoder.layer.{i}.attention.self.rotary_embeddings.inv_freq"] = v.half().float()
        else:
            sd[k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")] = v
    save_file(sd, old / "model.safetensors", metadata={"format": "pt"})

    with torch.no_grad():
        direct = lm.esm(input_ids=ESM_IDS, attention_mask=ESM_MASK, output_hidden_states=True).hidden_states
    for folder in (new, old):
        want = esm_reference(folder)
        if folder == new:
            torch.testing.assert_close(want[-1], direct[-1], atol=1e-6, rtol=0)
        model = load_model("esm2", folder)
        assert model.contact_head is None
        torch.testing.assert_close(esm_out(model), want[-1], atol=1e-6, rtol=0)
        torch.testing.assert_close(esm_out(load_model("esm2", folder, n_blocks=2)), want[2], atol=1e-6, rtol=0)
    rounded = load_model("esm2", old).rotary_embeddings.inv_freq
    assert torch.equal(rounded, sd["esm.encoder.layer.0.attention.self.rotary_embeddings.inv_freq"])


def test_esm2_sharded_and_bin_folders(esm_folder, tmp_path):
    """Shards with an index (as save_pretrained writes large models) and pytorch_model.bin."""
    from transformers import EsmModel

    want = esm_reference(esm_folder)[-1]
    ref = EsmModel.from_pretrained(str(esm_folder), local_files_only=True, add_pooling_layer=False)
    sharded = tmp_path / "sharded"
    ref.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("model-*.safetensors"))) > 2
    torch.testing.assert_close(esm_out(load_model("esm2", sharded)), want, atol=1e-6, rtol=0)
    binary = copy_folder(esm_folder, tmp_path / "bin")
    torch.save({f"esm.{k}": v for k, v in load_file(esm_folder / "model.safetensors").items()}, binary / "pytorch_model.bin")
    torch.testing.assert_close(esm_out(load_model("esm2", binary)), want, atol=1e-6, rtol=0)


# ------------------------------------------------------------------ DNABERT-S
@pytest.mark.parametrize("n_blocks", [None, 1])
def test_dnabert_equals_whole_model_load(dna_folder, tmp_path, n_blocks):
    """Exactly the network built whole and loaded with load_state_dict, from
    model.safetensors and from a hub-style pytorch_model.bin (bert. prefix, cls. head)."""
    ref = dnabert_reference(dna_folder)
    with torch.no_grad():
        want = ref(DNA_IDS, DNA_MASK, n_layers=n_blocks)
    binary = copy_folder(dna_folder, tmp_path / "bin")
    sd = {f"bert.{k}": v for k, v in ref.state_dict().items()}
    sd["cls.predictions.decoder.bias"] = torch.zeros(3)
    torch.save(sd, binary / "pytorch_model.bin")
    for folder in (dna_folder, binary):
        model = load_model("dnabert_s", folder, n_blocks=n_blocks)
        assert len(model.encoder.layer) == (LAYERS if n_blocks is None else n_blocks)
        with torch.no_grad():
            assert torch.equal(model(DNA_IDS, DNA_MASK), want)
    with torch.no_grad():
        assert torch.equal(load_model("dnabert_s", dna_folder)(DNA_IDS, DNA_MASK), ref(DNA_IDS, DNA_MASK))


# ------------------------------------------------------------------ precision
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision(esm_folder, dna_folder, dtype, capsys):
    """Parameters held in the dtype, nothing left on meta, outputs near fp32's."""
    torch_dtype = getattr(torch, dtype)
    ref = esm_reference(esm_folder)[-1]
    with torch.no_grad():
        dna_ref = dnabert_reference(dna_folder)(DNA_IDS, DNA_MASK)
    errs = {}
    for kind, folder in (("esm2", esm_folder), ("dnabert_s", dna_folder)):
        model = load_model(kind, folder, dtype=dtype)
        floating = [p for p in model.parameters() if p.is_floating_point()]
        assert floating and all(p.dtype == torch_dtype for p in floating)
        assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        with torch.no_grad():
            if kind == "esm2":
                got, want = esm_out(model), ref
            else:
                got, want = model(DNA_IDS, DNA_MASK), dna_ref
        assert got.dtype == torch_dtype
        # the padded positions of ESM-2 are not compared: nothing reads them
        valid = (ESM_MASK if kind == "esm2" else DNA_MASK).bool()
        errs[kind] = ((got.float() - want).abs()[valid].max() / want[valid].abs().max()).item()
    with capsys.disabled():
        print(f"\n{dtype} vs float32, max |difference| / max |fp32 value|: " + ", ".join(f"{k} {v:.4f}" for k, v in errs.items()))
    # measured on these tiny random models: bf16 0.008 (ESM-2) and 0.015 (DNABERT-S) of the
    # largest value, fp16 0.0007 and 0.0013 (bf16 keeps 8 bits of mantissa, fp16 11)
    assert max(errs.values()) < (0.03 if dtype == "bfloat16" else 0.005)


# ------------------------------------------------------------------ bad folders
def test_mismatched_checkpoints_name_the_folder(esm_folder, dna_folder, tmp_path):
    for kind, folder in (("esm2", esm_folder), ("dnabert_s", dna_folder)):
        sd = load_file(folder / "model.safetensors")
        missing = copy_folder(folder, tmp_path / f"{kind}_missing")
        save_file({k: v for k, v in sd.items() if "layer.0.attention" not in k}, missing / "model.safetensors")
        with pytest.raises(InputError, match="missing") as e:
            load_model(kind, missing)
        assert str(missing) in str(e.value)
        extra = copy_folder(folder, tmp_path / f"{kind}_extra")
        save_file({**sd, "encoder.layer.0.surprise": torch.zeros(2)}, extra / "model.safetensors")
        with pytest.raises(InputError, match=r"unexpected \['encoder.layer.0.surprise'\]") as e:
            load_model(kind, extra)
        assert str(extra) in str(e.value)
    with pytest.raises(InputError, match="no weights"):
        load_model("esm2", copy_folder(esm_folder, tmp_path / "empty"))
    with pytest.raises(InputError, match="dtype"):
        load_model("esm2", esm_folder, dtype="int8")


# ------------------------------------------------------------------ the lock
def test_load_lock_waits_for_the_holder_and_not_for_a_dead_one(tmp_path, caplog):
    """A second process waits while the first holds the lock; killing the holder frees it."""
    lock = tmp_path / "locks" / "load.lock"
    code = "import sys, time\nfrom ampflow.extract.weights import load_lock\nwith load_lock(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(600)\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen([sys.executable, "-c", code, str(lock)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        threading.Timer(1.0, holder.kill).start()
        t0 = time.monotonic()
        with caplog.at_level("INFO", logger="ampflow.extract.weights"), load_lock(lock):
            waited = time.monotonic() - t0
        assert 0.9 < waited < 30
        assert "waited" in caplog.text
        with load_lock(lock):  # released on leaving the block
            pass
    finally:
        holder.kill()
        holder.wait()


# ------------------------------------------------------------------ host memory
def _smaps(pid: int) -> dict[str, int]:
    """Rss and Pss (bytes) from /proc/PID/smaps_rollup; Pss counts a page shared by k
    processes as 1/k to each."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        for line in fh:
            name, _, rest = line.partition(":")
            if name in ("Rss", "Pss"):
                out[name] = int(rest.split()[0]) * 1024
    return out


def _memory_worker(folder: str, path: str, dtype: str, results, stop) -> None:
    """Load as an extraction worker would, run one forward pass, hold the model."""
    from transformers import EsmModel

    torch.set_num_threads(1)
    before = _smaps(os.getpid())["Rss"]
    if path == "streaming":
        model = load_model("esm2", folder, dtype=dtype)
    else:  # the path models.py used: whole fp32 model on the host
        model = EsmModel.from_pretrained(folder, local_files_only=True, add_pooling_layer=False).eval()
    with torch.inference_mode():
        model(input_ids=ESM_IDS, attention_mask=ESM_MASK)
    results.put(before)
    stop.wait()


def _peak_memory(folder: Path, path: str, n: int, dtype: str = "float32") -> dict:
    """Spawn n workers and sample their summed Pss and Rss every 0.05 s until all hold a
    loaded model (and 0.5 s more). Returns the peaks and the workers' Rss before loading."""
    ctx = mp.get_context("spawn")
    results, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_memory_worker, args=(str(folder), path, dtype, results, stop)) for _ in range(n)]
    for p in procs:
        p.start()
    peak = {"Pss": 0, "Rss": 0}
    before, settled = [], None
    try:
        while settled is None or time.monotonic() < settled + 0.5:
            total = {"Pss": 0, "Rss": 0}
            for p in procs:
                assert p.is_alive(), f"worker exited with {p.exitcode}"
                try:
                    for k, v in _smaps(p.pid).items():
                        total[k] += v
                except FileNotFoundError:  # not yet exec'd
                    pass
            peak = {k: max(peak[k], total[k]) for k in peak}
            try:
                before.append(results.get(timeout=0.05))
            except queue.Empty:
                pass
            if settled is None and len(before) == n:
                settled = time.monotonic()
    finally:
        stop.set()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    return {**peak, "before": sum(before)}


ESM2_650M_BYTES = 2.7e9  # its model.safetensors, fp32


@pytest.fixture(scope="module")
def esm_650m(tmp_path_factory) -> Iterator[tuple[Path, int]]:
    """An ESM-2 650M-shaped folder (~2.6 GB fp32) and its weight bytes, removed after the
    module: the largest thing the suite writes, which pytest would otherwise keep with its
    last three temporary roots (6.4 GB on a disk that then ran out of space)."""
    root = tmp_path_factory.mktemp("big")
    free = shutil.disk_usage(root).free
    if free < 2 * ESM2_650M_BYTES:  # the file, and room for the other tests' files beside it
        pytest.skip(f"{root}: {free / 1e9:.1f} GB free, the 650M model needs {2 * ESM2_650M_BYTES / 1e9:.1f} GB")
    folder = write_esm2(root / "esm2_650m", **ESM2_650M)
    try:
        yield folder, (folder / "model.safetensors").stat().st_size
    finally:
        shutil.rmtree(root, ignore_errors=True)


GB = 1e9


@pytest.mark.slow
def test_cpu_workers_share_one_copy(esm_650m, capsys):
    """Two CPU workers loading the same model hold about one copy of its weights between
    them (Pss: the file's pages, mapped by both). transformers 5's from_pretrained maps
    an fp32 safetensors file the same way; it is measured alongside for comparison."""
    folder, weights = esm_650m
    new1, new2 = _peak_memory(folder, "streaming", 1), _peak_memory(folder, "streaming", 2)
    old1, old2 = _peak_memory(folder, "from_pretrained", 1), _peak_memory(folder, "from_pretrained", 2)
    with capsys.disabled():
        print(f"\nweights {weights / GB:.2f} GB (fp32); peak summed over the workers:")
        for name, one, two in (("streaming", new1, new2), ("from_pretrained", old1, old2)):
            print(
                f"  {name:>15}: 1 worker Pss {one['Pss'] / GB:.2f} GB, Rss {one['Rss'] / GB:.2f} GB; "
                f"2 workers Pss {two['Pss'] / GB:.2f} GB, Rss {two['Rss'] / GB:.2f} GB; "
                f"2/1 Pss {two['Pss'] / one['Pss']:.2f}, Rss {two['Rss'] / one['Rss']:.2f}; "
                f"Rss before loading {one['before'] / GB:.2f} GB a worker"
            )
        print(f"  2 workers, from_pretrained / streaming Pss: {old2['Pss'] / new2['Pss']:.2f}")
    assert new2["Pss"] <= 1.3 * new1["Pss"]
    assert new2["Pss"] < new1["Pss"] + 0.5 * weights
    assert new2["Pss"] <= 1.05 * old2["Pss"]


@pytest.mark.slow
def test_bfloat16_cpu_load_converts_tensor_by_tensor(esm_650m, capsys):
    """In bf16 a worker's peak Rss grows by about half the fp32 weights: each tensor is
    converted as it is read, never a whole fp32 model first."""
    folder, weights = esm_650m
    fp32, bf16 = _peak_memory(folder, "streaming", 1), _peak_memory(folder, "streaming", 1, "bfloat16")
    grow32, grow16 = fp32["Rss"] - fp32["before"], bf16["Rss"] - bf16["before"]
    with capsys.disabled():
        print(
            f"\none worker, peak Rss: fp32 {fp32['Rss'] / GB:.2f} GB, bf16 {bf16['Rss'] / GB:.2f} GB "
            f"(ratio {bf16['Rss'] / fp32['Rss']:.2f}); growth over the {fp32['before'] / GB:.2f} GB before loading: "
            f"fp32 {grow32 / GB:.2f} GB, bf16 {grow16 / GB:.2f} GB (ratio {grow16 / grow32:.2f}); weights {weights / GB:.2f} GB fp32"
        )
    # measured 0.56: the bf16 weights (0.50) and ~0.13 GB of freed fp32 read buffers that
    # the C allocator keeps for reuse; a whole fp32 model first would give 1.5
    assert grow16 < 0.65 * grow32
    assert grow16 < 0.65 * weights
