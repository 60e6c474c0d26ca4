"""rules.args: the shell arguments the workflow's rules build from config
sections; expected strings written out by hand."""

from __future__ import annotations

import shlex
from types import SimpleNamespace

import pytest

from ampflow.base.errors import InputError
from ampflow.rules.args import (
    calibration_args,
    chromosomes_arg,
    extract_folder_arg,
    extract_input_args,
    extract_model_inputs,
    extract_settings_arg,
    label_arg,
    naming_args,
    qc_args,
    shell_json,
)


def test_shell_json_is_one_quoted_argument_with_sorted_keys():
    arg = shell_json({"b": 1, "a": "x y", "c": None})
    assert arg == """'{"a": "x y", "b": 1, "c": null}'"""
    assert shlex.split(arg) == ['{"a": "x y", "b": 1, "c": null}']


def test_calibration_args_carry_only_what_is_measured():
    """The devices rule's params: the decoder's width (the latent size where no
    decoder_dim is set), heads, window and feed-forward shape, the encoders' hidden
    width, the batch, the device and threads; defaults filled in, the rest of the
    sections left out."""
    model = {"latent_dim": 32, "hidden_dim": 256, "heads": 4, "window": 8, "dropout": 0.1}
    train = {"device": "cpu", "seed": 3, "pretrain": {"epochs": 36, "lr": 0.005}}
    args = calibration_args(model, train)
    assert args == (
        """--model '{"decoder_dim": 32, "ffn_mult": 2, "heads": 4, "hidden_dim": 256, "window": 8}'"""
        """ --train '{"batch_size": 32, "device": "cpu", "threads": "auto"}'"""
    )
    assert calibration_args({**model, "decoder_dim": 16, "latent_dim": 8}, {**train, "seed": 4, "threads": 2}) == (
        """--model '{"decoder_dim": 16, "ffn_mult": 2, "heads": 4, "hidden_dim": 256, "window": 8}'"""
        """ --train '{"batch_size": 32, "device": "cpu", "threads": 2}'"""
    )
    # the sections are checked as the trainer checks them, naming the key
    with pytest.raises(InputError, match="model.heads"):
        calibration_args({**model, "heads": 5}, train)
    with pytest.raises(InputError, match=r"train: unknown key.*\[.seeds.\]"):
        calibration_args(model, {**train, "seeds": 1})


def test_chromosomes():
    assert chromosomes_arg([]) == ""
    assert chromosomes_arg(["chr1", "chrX"]) == "--chromosomes chr1,chrX"


def test_naming_args():
    default = {"chr_prefix": "auto", "chromosomes": [], "strip_prefix": ""}
    # the empty --chromosomes leaves its separating space
    assert naming_args(default, {"columns": "auto"}) == "--chr-prefix auto "
    full = {"chr_prefix": "add", "chromosomes": ["1", "2"], "strip_prefix": "chr"}
    assert naming_args(full, {"columns": "readID,chrom1,pos1,chrom2,pos2"}) == (
        "--chr-prefix add --chromosomes 1,2 --strip-prefix chr --pairs-columns readID,chrom1,pos1,chrom2,pos2"
    )


def test_qc_args_in_key_order():
    qc = {"min_contacts": 1000, "min_umis": 500, "min_cis_fraction": 0.5}
    assert qc_args(qc) == "--min-cis-fraction 0.5 --min-contacts 1000 --min-umis 500"
    assert qc_args({}) == ""


def test_label_arg():
    said = []
    assert label_arg("cell type", ["cell_id", "cell type"], said.append) == "--label-key 'cell type'"
    assert label_arg("cell_type", ["cell_id", "cell type"], said.append) == ""
    assert said == ["split: no column 'cell_type' in the cell sheet; a random split"]


def test_extract_settings_leave_out_inputs_and_models():
    extract = {"inputs": {"a": {}}, "models": {"m": {}}, "gpus": 1, "cpu_workers": 2}
    assert extract_settings_arg(extract) == """'{"cpu_workers": 2, "gpus": 1}'"""


INPUTS = {
    "a": {"fasta": "x/a.fa", "models": ["esm"]},
    "b": {"fasta": "my file.fa", "models": ["dna", "esm"], "policy": {"too_long": "window"}},
    "c": {"fasta": "c.fa", "models": ["dna"], "policy": {}},
}


def test_extract_model_inputs_in_config_order():
    assert extract_model_inputs(INPUTS, "esm") == ["a", "b"]
    assert extract_model_inputs(INPUTS, "dna") == ["b", "c"]
    assert extract_model_inputs(INPUTS, "other") == []


def test_extract_input_args():
    policies = """--policies '{"b": {"too_long": "window"}}'"""
    assert extract_input_args(INPUTS, "esm") == f"--input=a=x/a.fa '--input=b=my file.fa' {policies}"
    # an empty policy is no policy
    assert extract_input_args(INPUTS, "dna") == f"'--input=b=my file.fa' --input=c=c.fa {policies}"
    assert extract_input_args({"a": INPUTS["a"]}, "esm") == "--input=a=x/a.fa"


def test_extract_folder_arg_for_tiny_models_only():
    models = {"t": SimpleNamespace(tiny=True), "real": SimpleNamespace(tiny=False)}
    assert extract_folder_arg(models, "t") == "--model-folder resources/models/t"
    assert extract_folder_arg(models, "real") == ""
