"""Feature extraction: models, batching, the worker pool, the vector cache and resume.

Tiny randomly initialised ESM-2 and DNABERT-S-shaped models are built once per session
(nothing downloaded). Pools run 2 CPU worker processes, spawned as on GPUs.
"""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anndata as ad
import numpy as np
import pytest
import torch
from extract_doubles import InlinePool, doubles_env, pool_class
from extract_helpers import random_fasta, tiny_models_in

from ampflow.base.errors import InputError
from ampflow.extract.batching import fixed_batches, padding_fraction, token_budget_batches
from ampflow.extract.cache import VectorCache
from ampflow.extract.config import ExtractSettings, ModelSpec
from ampflow.extract.dnabert import DnabertModel
from ampflow.extract.models import load_embedder, model_shape, resolve_layer
from ampflow.extract.pool import choose_devices
from ampflow.extract.run import extract_fasta
from ampflow.extract.weights import load_model

BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    return tiny_models_in(tmp_path_factory)


def run(tmp_path, fasta, kind, folder, tag="run", pool=None, model=None, **settings):
    out = tmp_path / tag
    s = ExtractSettings.from_dict({"sequences_per_file": 10, "cpu_workers": 2, **settings})
    with pool_class(pool):
        summary = extract_fasta(
            fasta, ModelSpec(kind=kind, tiny=True, **(model or {})), f"{kind}_tiny", out / "work", out / "x.h5ad",
            out / "report.tsv", out / "telemetry.jsonl", out / "progress.jsonl", settings=s, model_folder=folder,
        )  # fmt: skip
    return summary, out


def one_at_a_time(kind, folder, seqs, product=None) -> np.ndarray:
    spec = ModelSpec(kind=kind, tiny=True)
    layer = resolve_layer(-1, model_shape(folder)[0])
    emb = load_embedder(spec, folder, [layer])
    product = product or f"L{layer}.{spec.poolings[0]}"
    return np.stack([emb.embed_batch(emb.tokenize([s]))[product][0] for s in seqs])


def shards(out) -> list[dict]:
    """The markers of the run's cache (one model, so one cache folder)."""
    (folder,) = [p for p in (out / "work" / "cache").iterdir()]
    return [json.loads(p.read_text()) for p in sorted((folder / "shards").glob("*.done"))]


# ------------------------------------------------------------------ batching
def test_token_budget_batches():
    lengths = [5, 100, 7, 100, 50, 3000, 6]
    batches = token_budget_batches(lengths, 210)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert batches[0] == [5]  # longer than the budget: alone, and first
    for b in batches:
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 210
        assert [lengths[i] for i in b] == sorted((lengths[i] for i in b), reverse=True)
    assert batches == token_budget_batches(lengths, 210)
    assert padding_fraction(lengths, batches) < padding_fraction(lengths, fixed_batches(len(lengths), 2))


# ------------------------------------------------------------------ models
def test_esm_tokens_equal_the_tokenizer(tiny_models):
    spec = ModelSpec(kind="esm2", tiny=True)
    emb = load_embedder(spec, tiny_models["esm2"], [2])
    seqs = ["MKTAYIAKQR", "XBZUOJ", "M"]
    enc = emb.tokenizer(seqs, return_special_tokens_mask=True)
    got = emb.tokenize(seqs)
    assert [t.ids for t in got] == enc["input_ids"]
    assert [[not p for p in t.own] for t in got] == [[bool(m) for m in row] for row in enc["special_tokens_mask"]]


def test_esm_layer_equals_hidden_state(tiny_models):
    """Layer k pools hidden_states[k] of the full model; the last layer is after the final
    LayerNorm. Several layers and poolings come from one pass and equal one layer at a time."""
    from transformers import EsmModel

    folder = tiny_models["esm2"]
    full = EsmModel.from_pretrained(str(folder), local_files_only=True, add_pooling_layer=False).eval()
    seq = "MKTAYIAKQRQISFVKSHFSRQ"
    both = load_embedder(ModelSpec(kind="esm2", tiny=True, layer=[2, 1, 0], pooling=["mean", "bos", "mean_special"]), folder, [2, 1, 0])
    ids = torch.tensor([both.tokenize([seq])[0].ids])
    with torch.no_grad():
        hs = full(input_ids=ids, output_hidden_states=True).hidden_states
        last = full(input_ids=ids).last_hidden_state
    np.testing.assert_allclose(hs[2], last, atol=1e-6)
    got = both.embed_batch(both.tokenize([seq]))
    for layer in (0, 1, 2):
        alone = load_embedder(ModelSpec(kind="esm2", tiny=True), folder, [layer])
        one = alone.embed_batch(alone.tokenize([seq]))[f"L{layer}.mean"][0]
        np.testing.assert_allclose(one, hs[layer][0, 1:-1].mean(0).numpy(), atol=1e-6)
        np.testing.assert_allclose(got[f"L{layer}.mean"][0], one, atol=1e-6)
        np.testing.assert_allclose(got[f"L{layer}.bos"][0], hs[layer][0, 0].numpy(), atol=1e-6)
        np.testing.assert_allclose(got[f"L{layer}.mean_special"][0], hs[layer][0].mean(0).numpy(), atol=1e-6)


def test_dnabert_default_pooling_is_the_model_cards(tiny_models):
    """DNABERT-S's card pools torch.mean(hidden_states[0], dim=0): every token, [CLS] and
    [SEP] included; that is the default for dnabert_s (mean over residues for ESM-2)."""
    folder = tiny_models["dnabert_s"]
    spec = ModelSpec(kind="dnabert_s", tiny=True)
    assert spec.poolings == ["mean_special"] and ModelSpec(kind="esm2", tiny=True).poolings == ["mean"]
    emb = load_embedder(spec, folder, [2])
    seq = "ACGTTGCAAGGCTTAACGATCGATCGGATC"
    inputs = emb.tokenizer(seq, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        hidden = emb.model(inputs, torch.ones_like(inputs))[0]
    np.testing.assert_allclose(emb.embed_batch(emb.tokenize([seq]))["L2.mean_special"][0], torch.mean(hidden, dim=0).numpy(), atol=1e-6)


def test_dnabert_loads_hub_style_checkpoints(tiny_models, tmp_path):
    """A pytorch_model.bin with 'bert.' names and a masked-LM head loads like safetensors."""
    folder = tiny_models["dnabert_s"]
    model = load_model("dnabert_s", folder)
    alt = tmp_path / "bin"
    alt.mkdir()
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (alt / f.name).write_bytes(f.read_bytes())
    sd = {f"bert.{k}": v for k, v in model.state_dict().items()}
    sd["cls.predictions.decoder.bias"] = torch.zeros(3)
    torch.save(sd, alt / "pytorch_model.bin")
    again = load_model("dnabert_s", alt)
    ids, mask = torch.tensor([[1, 7, 9, 2]]), torch.ones(1, 4, dtype=torch.long)
    with torch.no_grad():
        assert torch.equal(model(ids, mask), again(ids, mask))
    sd.pop("bert.encoder.layer.0.mlp.wo.weight")
    torch.save(sd, alt / "pytorch_model.bin")
    with pytest.raises(InputError, match="missing"):
        load_model("dnabert_s", alt)


def test_dnabert_attention_ignores_padding(tiny_models):
    """Right padding changes nothing for the real tokens (ALiBi is position-relative)."""
    model: DnabertModel = load_model("dnabert_s", tiny_models["dnabert_s"])
    ids = torch.tensor([[1, 7, 9, 11, 2, 3, 3]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0]])
    with torch.no_grad():
        padded = model(ids, mask)[0, :5]
        alone = model(ids[:, :5], mask[:, :5])[0]
    torch.testing.assert_close(padded, alone, atol=1e-6, rtol=0)


# ------------------------------------------------------------------ the pool
@pytest.mark.parametrize("kind", ["esm2", "dnabert_s"])
def test_batch_independence(tiny_models, tmp_path, kind):
    """Pool (2 spawned CPU workers, length-sorted token-budget batches, chunks) equals
    one-sequence-at-a-time inference to 1e-5 in fp32."""
    fasta = random_fasta(tmp_path / "in.fa", kind, 40, lengths=(3, 700) if kind == "esm2" else (20, 2000))
    summary, out = run(tmp_path, fasta, kind, tiny_models[kind], model={"tokens_per_batch": 2048})
    # 40 sequences, up to 10 a chunk, 4 chunks per worker: 8 chunks of 5
    assert summary["run"]["computed"] == 40 and summary["run"]["cached"] == 0 and summary["run"]["chunks"] == 8
    assert sum(w.get("chunks", 0) for w in summary["run"]["workers"]) == 8
    a = ad.read_h5ad(out / "x.h5ad")
    assert list(a.obs_names) == [f"s{i}" for i in range(40)]
    seqs = [rec.split("\n", 1)[1].replace("\n", "") for rec in fasta.read_text().split(">")[1:]]
    ref = one_at_a_time(kind, tiny_models[kind], seqs)
    diff = float(np.abs(a.X - ref).max())
    print(f"{kind}: batched pool vs one at a time, max abs difference {diff:.3g}")
    assert diff < 1e-5
    uns = a.uns["extract"]
    assert uns["poolings"] == list(ModelSpec(kind=kind, tiny=True).poolings) and uns["dtype"] == "float32" and list(uns["layers"]) == [2]
    assert uns["model"]["kind"] == kind and uns["model"]["fingerprint"].startswith("sha256:")
    assert json.loads((out / "telemetry.jsonl").read_text().splitlines()[0])["note"].startswith("no GPU")
    assert not list(out.rglob(".tmp-*"))


def test_cache_decides_what_is_redone(tiny_models, tmp_path):
    """A shard with a valid marker and matching size is reused; a truncated shard, a
    missing marker, a garbled one or one whose writer was killed before its marker's
    rename = its sequences computed again; other weights = a cache folder of their own."""
    fasta = random_fasta(tmp_path / "in.fa", "esm2", 50, lengths=(5, 60))
    summary, out = run(tmp_path, fasta, "esm2", tiny_models["esm2"], pool=InlinePool, cpu_workers=1)
    first = ad.read_h5ad(out / "x.h5ad").X.copy()
    assert summary["run"]["computed"] == 50 and summary["run"]["chunks"] == 5
    marks = shards(out)
    assert len(marks) == 5 and all(m["n_sequences"] == 10 for m in marks)
    assert {"output_sha256", "output_bytes", "keys", "products", "worker", "seconds", "finished"} <= set(marks[0])
    folder = next((out / "work" / "cache").iterdir()) / "shards"
    npz = folder / marks[1]["output"]
    npz.write_bytes(npz.read_bytes()[:-7])  # truncated, marker still there
    (folder / f"{marks[2]['shard']}.done").unlink()
    (folder / f"{marks[3]['shard']}.done").write_text("{")
    # killed between writing the marker's temporary and renaming it: complete JSON and a
    # complete .npz under a hidden name that a plain glob("*.done") would also match
    marker_temp = folder / f".tmp-997-{marks[4]['shard']}.done"
    (folder / f"{marks[4]['shard']}.done").rename(marker_temp)
    # temporaries of killed writers: an old one is removed, a fresh one (perhaps another
    # job's, writing now) is left
    old, fresh = folder / ".tmp-999-x.npz", folder / ".tmp-998-y.npz"
    old.write_bytes(b"half")
    fresh.write_bytes(b"half")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    summary, _ = run(tmp_path, fasta, "esm2", tiny_models["esm2"], pool=InlinePool, cpu_workers=1)
    assert (summary["run"]["computed"], summary["run"]["cached"]) == (40, 10)
    # recomputed in other batches: equal up to rounding
    np.testing.assert_allclose(ad.read_h5ad(out / "x.h5ad").X, first, rtol=0, atol=1e-6)
    assert not old.exists() and fresh.exists() and marker_temp.exists()
    fresh.unlink()
    summary, _ = run(tmp_path, fasta, "esm2", tiny_models["esm2"], pool=InlinePool, cpu_workers=1)
    assert (summary["run"]["computed"], summary["run"]["cached"]) == (0, 50)

    ident = summary["ident"]
    assert VectorCache(out / "work" / "cache", ident).dir.name in {p.name for p in (out / "work" / "cache").iterdir()}
    other = VectorCache(tmp_path / "c", {**ident, "fingerprint": "sha256:other"})
    assert other.dir.name != VectorCache(tmp_path / "c", ident).dir.name


def test_rerun_with_every_chunk_done_rebuilds_every_output(tiny_models, tmp_path):
    """After a crash the re-run finds every chunk done and Snakemake has deleted the
    job's outputs: it writes them all again, the progress (from the markers) byte for byte,
    and the extraction report made from them equals the first run's, file for file."""
    from ampflow.cli import main

    fasta = random_fasta(tmp_path / "in.fa", "esm2", 50, lengths=(5, 60))
    summary, out = run(tmp_path, fasta, "esm2", tiny_models["esm2"], pool=InlinePool, cpu_workers=1)
    assert (summary["run"]["computed"], summary["run"]["chunks"]) == (50, 5)
    outputs = ("x.h5ad", "report.tsv", "telemetry.jsonl", "progress.jsonl")

    def report(folder):
        args = ["report-extraction", "--progress", out / "progress.jsonl", "--telemetry", out / "telemetry.jsonl",
                "--records", out / "report.tsv", "--out-dir", folder, "--name", "in.esm2"]  # fmt: skip
        assert main([str(a) for a in args]) == 0
        return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir())}

    first = {name: (out / name).read_bytes() for name in outputs}
    first_report = report(tmp_path / "report1")
    assert sorted(first_report) == ["gpus.png", "records.html", "throughput.png"]

    # the progress is the shards' markers': one row per shard at its finish time, after a start row
    rows = [json.loads(ln) for ln in first["progress.jsonl"].decode().splitlines()]
    markers = {m["shard"]: m for m in shards(out)}
    assert [r["sequences"] for r in rows] == [0, 10, 20, 30, 40, 50] and {r["total"] for r in rows} == {50}
    assert sorted(r["chunk"] for r in rows[1:]) == sorted(markers)
    assert [r["time"] for r in rows[1:]] == sorted(m["finished"] for m in markers.values())
    assert rows[0]["time"] == pytest.approx(rows[1]["time"] - markers[rows[1]["chunk"]]["seconds"], abs=1e-3)

    for name in outputs:
        (out / name).unlink()
    summary, _ = run(tmp_path, fasta, "esm2", tiny_models["esm2"], pool=InlinePool, cpu_workers=1)
    assert (summary["run"]["computed"], summary["run"]["cached"]) == (0, 50)
    for name in ("report.tsv", "telemetry.jsonl", "progress.jsonl"):
        assert (out / name).read_bytes() == first[name], name
    assert np.array_equal(ad.read_h5ad(out / "x.h5ad").X, ad.read_h5ad(io.BytesIO(first["x.h5ad"])).X)
    assert report(tmp_path / "report2") == first_report


def test_device_auto_without_usable_cuda_falls_back_to_cpu(monkeypatch, caplog):
    """A GPU allocation (CUDA_VISIBLE_DEVICES set) with a torch that cannot use CUDA:
    auto runs the CPU workers after one warning; cuda is one InputError naming the key."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    for built, available in ((False, False), (True, False)):
        monkeypatch.setattr(torch.backends.cuda, "is_built", lambda built=built: built)
        monkeypatch.setattr(torch.cuda, "is_available", lambda available=available: available)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ampflow.extract.pool"):
            assert choose_devices("auto", 2, 3) == ("cpu", [None, None, None])
        assert len(caplog.records) == 1, caplog.text
        text = caplog.records[0].getMessage()
        assert "no usable GPU" in text and "3 CPU worker(s)" in text and "\n" not in text
        assert ("built without CUDA" if not built else "is_available() is False") in text
        with pytest.raises(InputError, match=r"extract.device: no usable GPU.*\(value: 'cuda'\)") as e:
            choose_devices("cuda", 2, 3)
        assert "\n" not in str(e.value)
    # usable: one worker per visible GPU torch counts, up to extract.gpus
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert choose_devices("auto", 4, 3) == ("cuda", ["0", "1"])
    assert choose_devices("cuda", 1, 3) == ("cuda", ["0"])
    assert choose_devices("cpu", 4, 3) == ("cpu", [None, None, None])


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="needs a torch built without CUDA")
def test_cli_device_on_a_gpu_allocation_with_cpu_torch(tiny_models, tmp_path, monkeypatch, capfd):
    """This CPU-only torch with CUDA_VISIBLE_DEVICES=0, as on a SLURM GPU allocation:
    ``auto`` embeds on the CPU and says so once; ``cuda`` exits 2 with one line."""
    from ampflow.cli import main

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    fasta = random_fasta(tmp_path / "in.fa", "esm2", 6, lengths=(5, 30))

    def extract(device):
        out = tmp_path / device
        args = ["extract", f"--input=in={fasta}", "--model-name", "esm2_tiny", "--model", json.dumps({"kind": "esm2", "tiny": True}),
                "--model-folder", tiny_models["esm2"], "--settings", json.dumps({"device": device, "cpu_workers": 1}),
                "--work", out / "work", "--cache", out / "cache", "--record", out / "job.json"]  # fmt: skip
        rc = main([str(a) for a in args])
        if rc == 0:
            rc = main([str(a) for a in ["extract-outputs", "--record", out / "job.json", "--name", "in", "--out", out / "x.h5ad"]])
        return rc, out, capfd.readouterr().err

    rc, out, err = extract("auto")
    assert rc == 0, err
    assert ad.read_h5ad(out / "x.h5ad").n_obs == 6
    warned = [ln for ln in err.splitlines() if "WARNING" in ln]
    assert len(warned) == 1 and "extract.device auto: no usable GPU (torch" in warned[0], err
    assert "Traceback" not in err and "1 cpu worker(s)" in err
    rc, out, err = extract("cuda")
    assert rc == 2 and "Traceback" not in err
    lines = [ln for ln in err.splitlines() if "extract.device" in ln]
    assert lines and all("no usable GPU: torch" in ln and "(value: 'cuda')" in ln for ln in lines), err
    assert not (out / "x.h5ad").exists() and not (out / "job.json").exists()


@pytest.mark.slow
def test_a_killed_worker_is_replaced_and_its_chunk_redone(tiny_models, tmp_path):
    """SIGKILL one worker process mid-run: its chunk goes back to the queue, a new
    worker takes over, the result equals an undisturbed run."""
    fasta = random_fasta(tmp_path / "in.fa", "esm2", 80, lengths=(5, 200))
    _, ref = run(tmp_path, fasta, "esm2", tiny_models["esm2"], tag="ref", pool=InlinePool)
    out = tmp_path / "killed"
    cmd = [
        str(BIN / "ampflow"), "extract", f"--input=in={fasta}", "--model-name", "esm2_tiny",
        "--model", json.dumps({"kind": "esm2", "tiny": True}), "--model-folder", str(tiny_models["esm2"]),
        "--settings", json.dumps({"sequences_per_file": 10, "cpu_workers": 2}), "--work", str(out / "work"),
        "--cache", str(out / "work" / "cache"), "--record", str(out / "job.json"),
    ]  # fmt: skip
    log = tmp_path / "killed.log"
    with open(log, "w") as fh:  # each worker waits 1 s after each chunk: a window to kill one in
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=doubles_env(tmp_path / "site", chunk_delay=1.0))
    try:
        deadline = time.monotonic() + 120
        while "model loaded" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)  # inside its first chunk or the wait after it
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        workers = [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert workers, children
        os.kill(workers[0], signal.SIGKILL)
        assert proc.wait(timeout=180) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "died (signal SIGKILL)" in text and "starting a new worker in its place" in text
    from ampflow.cli import main

    assert main(["extract-outputs", "--record", str(out / "job.json"), "--name", "in", "--out", str(out / "x.h5ad")]) == 0
    a = ad.read_h5ad(out / "x.h5ad")
    assert list(a.obs_names) == [f"s{i}" for i in range(80)]
    np.testing.assert_allclose(a.X, ad.read_h5ad(ref / "x.h5ad").X, atol=1e-6)


# ------------------------------------------------------------------ errors
def test_bad_input_exits_2_without_outputs(tiny_models, tmp_path):
    fasta = tmp_path / "bad.fa"
    fasta.write_text(">a\nMKT\n>a\nMKV\n")
    from ampflow.cli import main

    args = [
        "extract", f"--input=bad={fasta}", "--model-name", "m", "--model", json.dumps({"kind": "esm2", "tiny": True}),
        "--model-folder", str(tiny_models["esm2"]), "--work", str(tmp_path / "w"), "--cache", str(tmp_path / "c"),
        "--record", str(tmp_path / "x.json"),
    ]  # fmt: skip
    assert main(args) == 2
    assert not (tmp_path / "x.json").exists()
    fasta.write_text(">a\nMKT\n")
    i = args.index("--model-folder")
    del args[i : i + 2]
    args[args.index("--model") + 1] = json.dumps({"kind": "esm2", "source": str(tmp_path / "nowhere")})
    with pytest.raises(InputError, match="extract.models.source"):
        from ampflow.extract.models import resolve_source

        resolve_source(str(tmp_path / "nowhere"))
    assert main(args) == 2
    assert not (tmp_path / "x.json").exists()
    with pytest.raises(InputError, match="extract.models.layer"):
        resolve_layer(5, 2)
    with pytest.raises(InputError, match="extract.models.kind"):
        ModelSpec(kind="esm3", source="x")


def test_hub_name_from_the_local_cache(tiny_models, tmp_path):
    """A hub name resolves to its snapshot in the local cache, offline; nothing is fetched."""
    import shutil

    commit = "0" * 40
    repo = tmp_path / "hub" / "models--acme--esm2-tiny"
    shutil.copytree(tiny_models["esm2"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    code = "from ampflow.extract.models import resolve_source, model_shape;p = resolve_source('acme/esm2-tiny'); print(p.name, model_shape(p))"
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [commit, "(2,", "32)"]
    code = "from ampflow.extract.models import resolve_source; resolve_source('acme/not-cached')"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "hf download" in r.stderr
