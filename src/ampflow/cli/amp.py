"""Commands of AMP: profile a data folder, diagnose a plan, explain it, record the devices,
calibrate the cost model on them."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from ..base.errors import InputError

log = logging.getLogger("ampflow")


def _settings(json_text, path, section):
    """A config section from --SECTION JSON or from a YAML/JSON file's SECTION key (or the whole file)."""
    import yaml

    if json_text:
        return json.loads(json_text)
    if path:
        doc = yaml.safe_load(Path(path).read_text()) or {}
        return doc.get(section, doc if section == "model" else {})
    return {}


def cmd_profile(a):
    from ..amp.profile import main_profile

    model = _settings(a.model, a.model_config, "model")
    train = _settings(a.train, a.model_config, "train")
    main_profile(a.data_dir, model, train, a.out)
    log.info("profile of %s written to %s", a.data_dir, a.out)


def _device_memory(arg: str, devices_file: str | None = None) -> int:
    """Bytes per device: a number of GB, or 'auto' = the least free memory among the
    GPUs in ``devices_file`` (written by `ampflow devices` on a GPU node) or seen here."""
    if arg != "auto":
        try:
            gb = float(arg)
        except ValueError:
            raise InputError("must be a number of GB or 'auto'", key="device_memory", value=arg) from None
        return int(gb * 2**30)
    from ..devices import probe_devices

    info = json.loads(Path(devices_file).read_text()) if devices_file else probe_devices()
    free = [d["memory_free"] for d in info["devices"] if "memory_free" in d]
    if not free:
        raise InputError("'auto' needs visible NVIDIA GPUs (NVML); give the memory per device in GB", key="device_memory", value=info.get("nvml"))
    return min(free)


def cmd_diagnose(a):
    from ..amp.cost.model import read_calibration
    from ..amp.decide.diagnose import diagnose
    from ..contract.config import TrainConfig, amp_devices
    from ..contract.profile import read_profile
    from ..devices import probe_devices

    settings = {"dimensionality_ratio": a.dimensionality_ratio}
    constants = read_calibration(a.calibration) if a.calibration else None
    train = TrainConfig.from_dict(_settings(a.train, a.model_config, "train"))
    # the plan is a function of the devices record; without one, of this host's GPUs and
    # cores (not its available memory, which changes from one moment to the next)
    if a.devices_file:
        host = json.loads(Path(a.devices_file).read_text())
    else:
        host = probe_devices()
        host["cpu"] = {k: v for k, v in host["cpu"].items() if k != "memory_available_bytes"}
    # amp.devices auto: the GPUs of that record (none: refused before anything is planned)
    devices = amp_devices(a.devices, host)
    if str(a.devices).strip() == "auto":
        log.info("amp.devices %s: %d GPU(s) listed in %s", a.devices, devices, a.devices_file or "this host's probe")
    memory = _device_memory(a.device_memory, a.devices_file)
    plan = diagnose(read_profile(a.profile), devices, memory, a.budget_fraction, settings=settings, constants=constants,
                    train=train, host=host)  # fmt: skip
    plan.write(a.out)
    names = ", ".join(f"{s.id} {s.name}" for s in plan.strategies) or "none"
    threads = f"; {plan.threads} torch thread(s) per process" if plan.threads else ""
    log.info("plan: %s; mesh dp %d x tp %d on %s%s; fits=%s -> %s", names, plan.mesh.dp, plan.mesh.tp, plan.device or "train.device",
             threads, plan.fits, a.out)  # fmt: skip
    if plan.cpu is not None and plan.cpu.host_fits is False:
        from ..report.plan_text import host_memory_text

        log.warning("%s", host_memory_text(plan))


def cmd_plan_explain(a):
    from ..contract.plan import Plan
    from ..report.plan_text import explain

    sys.stdout.write(explain(Plan.read(a.plan)))


def cmd_devices(a):
    from ..base.atomic import write_text_atomic
    from ..devices import probe_devices

    info = probe_devices(a.cores)
    write_text_atomic(a.out, json.dumps(info, indent=2, sort_keys=True) + "\n")
    log.info("devices: %s", json.dumps(info))


def cmd_calibrate(a):
    from ..amp.cost.calibrate import calibrate
    from ..amp.cost.model import write_calibration
    from ..contract.config import ModelConfig, TrainConfig, calibration_sections

    model = ModelConfig.from_dict(_settings(a.model, a.model_config, "model"))
    train = TrainConfig.from_dict(_settings(a.train, a.model_config, "train"))
    # whole sections are welcome; the log says which of their settings are measured with
    log.info("calibrating with %s", json.dumps(calibration_sections(model, train), sort_keys=True))
    threads = train.explicit_threads
    if threads is None and a.devices_file:
        from ..amp.decide.cpu import threads_per_process
        from ..contract.config import amp_devices

        # time with the threads the plan will give each of its processes (amp.devices
        # auto: the GPUs the record lists, as the diagnosis counts them)
        host = json.loads(Path(a.devices_file).read_text())
        cores = (host.get("cpu") or {}).get("cores")
        threads = threads_per_process(cores, amp_devices(a.processes, host)) if cores else None
    doc = calibrate(model, train, anchors=a.anchors, blocks=a.blocks, reps=a.reps, threads=threads)
    write_calibration(a.out, doc)
    log.info("calibration (%s): %s -> %s", doc["device"], json.dumps(doc["constants"], sort_keys=True), a.out)


def add_commands(sub) -> None:
    """Add this group's subcommands to the ``ampflow`` parser."""
    s = sub.add_parser("profile", help="profile a data folder from metadata only (AMP step 1)")
    s.add_argument("data_dir")
    s.add_argument("--model-config", default=None, help="YAML/JSON with 'model' (and 'train') sections, or a model dict")
    s.add_argument("--model", default="", help="model settings as JSON (instead of --model-config)")
    s.add_argument("--train", default="", help="training settings as JSON (batch size)")
    s.add_argument("--out", required=True)
    s.set_defaults(func=cmd_profile)

    s = sub.add_parser("diagnose", help="signals -> strategies, mesh, chunk size: plan.json (AMP step 2)")
    s.add_argument("profile")
    s.add_argument("--devices", required=True, help="devices the plan is for (amp.devices): a number, or 'auto', the GPUs "
                   "--devices-file lists (default: this host's); auto with no GPU is refused")  # fmt: skip
    s.add_argument("--device-memory", required=True, help="GB per device, or 'auto' (free memory from NVML)")
    s.add_argument("--devices-file", default=None, help="devices.json from `ampflow devices`: GPUs (for --device-memory auto), "
                   "CPU cores and host memory (threads and batch check of a CPU run); default: probe this host")  # fmt: skip
    s.add_argument("--model-config", default=None, help="YAML/JSON with a 'train' section (device, threads)")
    s.add_argument("--train", default="", help="training settings as JSON: device and threads (CPU runs: threads per process)")
    s.add_argument("--budget-fraction", type=float, default=0.9)
    s.add_argument("--dimensionality-ratio", type=float, default=10.0, help="HIGH_INPUT_DIMENSIONALITY threshold")
    s.add_argument("--calibration", default=None, help="calibration.json from `ampflow calibrate` (default: the cost model's documented constants)")
    s.add_argument("--out", required=True)
    s.set_defaults(func=cmd_diagnose)

    s = sub.add_parser("plan-explain", help="print a plan as a readable table")
    s.add_argument("plan")
    s.set_defaults(func=cmd_plan_explain)

    s = sub.add_parser("devices", help="record the visible accelerators (NVML), CPU cores and host memory as JSON")
    s.add_argument("--cores", type=int, default=None, help="cap on the CPU cores recorded (those the job was granted); default: this process's affinity")
    s.add_argument("--out", required=True)
    s.set_defaults(func=cmd_devices)

    s = sub.add_parser("calibrate", help="time the decoder's kernels and the encoder's layers on the training device: the cost model's constants (JSON)")
    s.add_argument("--model-config", default=None, help="YAML/JSON with 'model' (and 'train') sections")
    s.add_argument("--model", default="", help="model settings as JSON: heads, decoder width, window, ffn_mult, hidden_dim (other keys: not used)")
    s.add_argument("--train", default="", help="training settings as JSON: device, threads and batch_size")
    s.add_argument("--anchors", type=int, default=4096, help="sequence length timed")
    s.add_argument("--blocks", type=int, default=64, help="query chunks of the chunked timing")
    s.add_argument("--reps", type=int, default=5, help="timed runs per setting (the fastest counts)")
    s.add_argument("--devices-file", default=None, help="devices.json: with train.threads auto, time with its cores / --processes threads")
    s.add_argument("--processes", default="1", help="training processes (amp.devices: a number, or 'auto', the GPUs --devices-file lists) sharing those cores")
    s.add_argument("--out", required=True)
    s.set_defaults(func=cmd_calibrate)
