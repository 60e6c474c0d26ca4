"""The real-data negative control (scripts/negative_control.py): real HiRES brain RNA,
each cell paired with an independent 15% subsample of one real embryo cell's contacts.

Nothing in that Hi-C can tell a cell's RNA partner, so on held-out cells FOSCTTM must read
chance, 0.5 +- 3 / sqrt(12 n), and the joint embedding must cluster no worse than the RNA
latent (ARI within 0.05): an uninformative modality may neither be aligned by memory nor
dilute the joint latent.
"""

from __future__ import annotations

import pytest
from conftest import load_script

nc = load_script("negative_control")


def result(foscttm_heldout=0.5, joint=0.7, rna=0.72, n=80):
    return nc.Result(
        n_heldout=n, n_train=4 * n, foscttm_heldout=foscttm_heldout, foscttm_train=0.06, shuffled_heldout=0.5,
        ari={"joint": joint, "rna_latent": rna, "hic_latent": 0.0, "rna_baseline": 0.75, "hic_baseline": 0.0},
        tolerance=3 / (12 * n) ** 0.5,
        depth_umi_spearman=0.0,
    )  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, passed",
    [
        ({}, True),
        ({"foscttm_heldout": 0.5 + 3 / (12 * 80) ** 0.5 - 1e-9}, True),  # just inside the band
        ({"foscttm_heldout": 0.27}, False),  # aligned by memory
        ({"joint": 0.67, "rna": 0.72}, True),  # exactly the allowance
        ({"joint": 0.32, "rna": 0.75}, False),  # diluted
        ({"joint": None}, False),  # not scored
    ],
)
def test_conditions(kwargs, passed):
    r = result(**kwargs)
    assert r.passed is passed
    assert bool(r.failures()) is not passed


@pytest.mark.parametrize("check, passed, code", [(False, False, 0), (True, True, 0), (True, False, 1)])
def test_exit_code_only_fails_with_check(monkeypatch, tmp_path, capsys, check, passed, code):
    """A report exits 0 whatever it found; --check exits 1 on FAIL (a test, or CI)."""
    monkeypatch.setattr(nc, "find_data", lambda d=None: tmp_path)
    monkeypatch.setattr(nc, "run_control", lambda *a, **k: result(joint=0.7 if passed else 0.2))
    argv = ["--work", str(tmp_path / "work")] + (["--check"] if check else [])
    assert nc.main(argv) == code
    out = capsys.readouterr().out
    assert ("[FAIL]" in out) is not passed and "FOSCTTM held-out" in out


@pytest.mark.slow
def test_real_negative_control(shared_data, tmp_path):
    """The whole control on real data through the workflow (1.5 to 2.5 min on 2 shared CPU cores)."""
    data = nc.find_data(shared_data)
    if data is None:
        pytest.skip(f"{shared_data} lacks the HiRES brain RNA, its labels, the embryo cell or the mm10 annotation")
    settings = nc.Settings()
    r = nc.run_control(tmp_path, data, settings, log=lambda *_: None)
    report = nc.table(r, settings)
    print(report)
    assert r.n_heldout >= 50, report
    # the shuffled control must read chance whatever the model did, or FOSCTTM itself is suspect
    assert abs(r.shuffled_heldout - 0.5) <= r.tolerance, report
    assert r.foscttm_at_chance, report
    assert r.joint_not_diluted, report


def test_defaults_config_trains_what_the_template_trains(tmp_path):
    """--defaults leaves the model keys and the train keys but seed and threads out, so the
    workflow's schema fills them in: the model and the training then equal the template's
    (config/config.yaml, the referee), seed and threads apart. Without it the control
    trains its own short schedule with attention off."""
    import dataclasses

    import yaml
    from conftest import REPO
    from snakemake.utils import validate

    from ampflow.contract.config import ModelConfig, TrainConfig

    template = yaml.safe_load((REPO / "config/config.yaml").read_text())
    schema = str(REPO / "workflow/schemas/config.schema.yaml")

    def trained(defaults):
        config = nc.control_config(tmp_path, nc.Settings(seed=3, defaults=defaults))
        validate(config, schema, set_default=True)
        return ModelConfig.from_dict(config["model"]), TrainConfig.from_dict(config["train"])

    model, train = trained(True)
    want = TrainConfig.from_dict(template["train"])
    assert model == ModelConfig.from_dict(template["model"])
    assert (train.seed, train.threads) == (3, 1)
    assert dataclasses.replace(train, seed=want.seed, threads=want.threads) == want
    model, train = trained(False)
    assert model != ModelConfig.from_dict(template["model"]) and train.pretrain.epochs == nc.Settings().pretrain_epochs


@pytest.mark.parametrize("code", [0, 3])
def test_workflow_run_relays_progress_and_names_its_log(monkeypatch, tmp_path, code):
    """While snakemake runs, the newest rule log's last line is relayed (the profiler's
    markers skipped); its own output lands in work/snakemake.log, whose tail a failure
    quotes. The stand-in writes a rule log, then runs on for 1.5 s: many 0.05 s ticks."""
    fake = tmp_path / "snakemake"
    fake.write_text(
        "#!/bin/sh\nmkdir -p logs/negctl\n"
        "printf 'INFO trained 5/10 steps (50.0%%), 9.0 steps/s, ETA 1s\\nUSDT: profiler_stop\\n' > logs/negctl/train.2mb_s8.log\n"
        f"echo 'snakemake says hello'\nsleep 1.5\necho 'last words'\nexit {code}\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr(nc, "tool", lambda name: str(fake))
    work = tmp_path / "work"
    work.mkdir()
    said = []

    def run():
        nc.run_workflow(work, nc.Settings(), log=said.append, every=0.05)

    if code:
        with pytest.raises(RuntimeError, match=r"exit 3(.|\n)*last words"):
            run()
    else:
        run()
    relayed = [m for m in said if "trained 5/10 steps" in m]
    assert relayed and all(m.rstrip().endswith("ETA 1s") for m in relayed)
    assert not any("USDT" in m for m in said)
    assert "snakemake says hello" in (work / "snakemake.log").read_text()
