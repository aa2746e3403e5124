"""Launch-time checks: the facts a config cannot show alone (DESIGN.md "Configuration checks").

`megatron_rl.config` checks what the config says (types, ranges, cross-section facts); the checks
here need the launch environment: the world size the launcher gives, files on disk, Transformer
Engine and the GPU, reachable rollout servers, the run dir's checkpoints. Each has a stable NAME
that `cli.py` (the layout checks before local ranks start, the `--dry-run` listing), the trainer
and `slurm/jobtool.py` refer to. A check raises `RuntimeError` with a clear message, and returns
None when it passed or a "not applicable: ..." reason when it did not apply.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from megatron_rl.config import Config

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Check:
    """One launch-time check: `run(cfg)` raises `RuntimeError` or returns None / a skip reason."""

    name: str
    """Stable identifier (`world_size`, `data_files`, ...)."""
    description: str
    """What it checks, in words (logged, and listed by `--dry-run`)."""
    run: Callable[[Config], Optional[str]]


def _world(cfg: Config) -> tuple[int, int]:
    t = cfg.trainer
    world = int(os.environ.get("WORLD_SIZE", t.nproc_per_node))
    return world, t.tensor_model_parallel_size * t.pipeline_model_parallel_size * t.context_parallel_size


def world_size(cfg: Config) -> None:
    t = cfg.trainer
    world, mp = _world(cfg)
    if world % mp:
        source = ("WORLD_SIZE from the launcher (torchrun / srun)" if "WORLD_SIZE" in os.environ
                  else "trainer.nproc_per_node")
        raise RuntimeError(
            f"world size {world} ({source}) is not divisible by trainer.tensor_model_parallel_size x "
            f"trainer.pipeline_model_parallel_size x trainer.context_parallel_size = "
            f"{t.tensor_model_parallel_size} x {t.pipeline_model_parallel_size} x {t.context_parallel_size} = {mp}: "
            f"set {'the number of processes' if 'WORLD_SIZE' in os.environ else 'trainer.nproc_per_node'} "
            f"to a multiple of {mp}"
        )
    emp = (t.expert_tensor_parallel_size or t.tensor_model_parallel_size) * t.expert_model_parallel_size * \
        t.pipeline_model_parallel_size
    if world % emp:
        raise RuntimeError(
            f"world size {world} is not divisible by trainer.expert_tensor_parallel_size x "
            f"trainer.expert_model_parallel_size x trainer.pipeline_model_parallel_size = {emp} (megatron-core's "
            f"expert layout): use a multiple of {emp} processes"
        )


def data_parallel_split(cfg: Config) -> None:
    world, mp = _world(cfg)
    if world % mp:
        return  # reported by world_size
    dp = world // mp
    mini = cfg.actor.ppo_mini_batch_size * cfg.rollout.n
    if mini % dp:
        raise RuntimeError(
            f"actor.ppo_mini_batch_size x rollout.n = {mini} sequences per mini-batch do not split over "
            f"{dp} data-parallel ranks (world {world} / TP*PP*CP {mp})"
        )


def run_dir(cfg: Config) -> Optional[str]:
    from megatron_rl.checkpoint.save import latest_checkpoint

    if cfg.trainer.resume_mode != "disable":
        return "not applicable: trainer.resume_mode is auto (a run dir with checkpoints is resumed)"
    latest = latest_checkpoint(cfg.run_dir)
    if latest is not None:
        raise RuntimeError(
            f"run_dir {cfg.run_dir} holds checkpoints of an earlier run (latest step {latest}) and "
            f"trainer.resume_mode is disable: use another run_dir, delete {cfg.run_dir}/checkpoints, or set "
            f"trainer.resume_mode=auto to continue it"
        )
    return None


def data_files(cfg: Config) -> None:
    if not cfg.data.train_files:
        raise RuntimeError("data.train_files: at least one file of training prompts is required")
    for f in list(cfg.data.train_files) + list(cfg.data.val_files):
        if not Path(f).is_file():
            raise RuntimeError(f"data file not found: {f}")


def transformer_impl(cfg: Config) -> Optional[str]:
    t = cfg.trainer
    if t.transformer_impl != "transformer_engine":
        return f"not applicable: trainer.transformer_impl is {t.transformer_impl}"
    from megatron_rl.models.builder import transformer_engine_usable

    if not transformer_engine_usable():
        raise RuntimeError(
            "trainer.transformer_impl=transformer_engine needs Transformer Engine and a CUDA GPU; "
            "use trainer.transformer_impl=auto (local layers without TE) or install Transformer Engine"
        )
    return None


def fp8(cfg: Config) -> Optional[str]:
    t = cfg.trainer
    if t.fp8 is None:
        return "not applicable: trainer.fp8 is unset"
    if importlib.util.find_spec("transformer_engine") is None:
        raise RuntimeError("trainer.fp8 is set but Transformer Engine is not installed "
                           "(pip install transformer-engine[pytorch]; FP8 GEMMs exist only in TE)")
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("trainer.fp8 needs a CUDA GPU (Hopper or newer); none is available")
    major, _ = torch.cuda.get_device_capability()
    if major < 9:
        raise RuntimeError(f"trainer.fp8 needs a Hopper (sm90) or newer GPU; found compute capability {major}.x")
    if t.fp8_recipe == "mxfp8" and major < 10:
        raise RuntimeError(f"trainer.fp8_recipe=mxfp8 needs a Blackwell (sm100) or newer GPU (Transformer Engine's "
                           f"MXFP8); found compute capability {major}.x: use fp8_recipe=delayed, tensorwise or "
                           "blockwise on Hopper")
    return None


def sequence_parallel(cfg: Config) -> Optional[str]:
    """Sequence parallelism runs with Transformer Engine's norms or, without it (e.g. on CPU), with
    the local spec's `models.sp_norm.SequenceParallelTorchNorm`: nothing to refuse."""
    if not cfg.trainer.sequence_parallel:
        return "not applicable: trainer.sequence_parallel is off"
    from megatron_rl.models.builder import transformer_engine_usable

    if not transformer_engine_usable():
        logger.info("trainer.sequence_parallel without Transformer Engine: torch norms marked sequence-parallel "
                    "(models/sp_norm.py)")
    return None


def model_files(cfg: Config) -> None:
    p = cfg.model.path
    if p is None or not (Path(p) / "config.json").is_file():
        raise RuntimeError(f"model.path {p!r} has no config.json")


def rollout_servers(cfg: Config) -> Optional[str]:
    if not cfg.rollout.server_urls:
        return "not applicable: rollout.server_urls is empty, embedded servers are started and health-checked at launch"
    from megatron_rl.rollout.client import RolloutClient

    for url in cfg.rollout.server_urls:
        RolloutClient(url, api_key=cfg.rollout.api_key, timeout_s=10).health()
    return None


#: The engine versions whose API the clients speak (docs/SGLANG_API.md, docs/VLLM_API.md): a launch with
#: another minor version is logged as a warning (its answers are checked per request).
ENGINE_PINS: dict[str, str] = {"sglang": "0.5.", "vllm": "0.33."}
#: megatron-rl's gloo weight-transfer engine for vLLM (plugins/vllm_gloo), needed with weight_sync.backend=gloo.
VLLM_GLOO_PLUGIN = "megatron-rl-vllm-gloo"


def engine_package_version(python: str, package: str, timeout_s: float = 120.0) -> Optional[str]:
    """The version of `package` installed for interpreter `python` (read from its metadata, without
    importing the package: vLLM takes ~20 s to import), or None when it is not installed there.

    Raises:
        RuntimeError: the interpreter could not be run or did not answer within `timeout_s` seconds.
    """
    import subprocess

    code = ("import importlib.metadata as m, sys\n"
            "try:\n    print(m.version(sys.argv[1]))\n"
            "except m.PackageNotFoundError:\n    sys.exit(3)\n")
    try:
        r = subprocess.run([python, "-c", code, package], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"could not ask {python!r} for its {package} version: {e}") from e
    if r.returncode == 3:
        return None
    if r.returncode:
        raise RuntimeError(f"{python!r} failed to report its {package} version (exit {r.returncode}): "
                           f"{r.stderr.strip()[-300:]}")
    return r.stdout.strip()


def engine_environment(cfg: Config) -> Optional[str]:
    """Engines this run starts itself with `rollout.backend` sglang or vllm: their interpreter
    (`rollout.sglang_python` / `rollout.vllm_python`) must exist and have the engine installed
    (a version other than the pinned minor, `ENGINE_PINS`, is a logged warning), and vLLM needs a
    CUDA GPU with `weight_sync.backend: nccl` (its NCCL weight transfer), megatron-rl's gloo plugin
    (`VLLM_GLOO_PLUGIN`) in its environment with `gloo` (the CPU build, scripts/setup_vllm_cpu.sh).
    Every problem found is reported in one `RuntimeError`, one per line."""
    import shutil

    r = cfg.rollout
    if r.backend not in ("sglang", "vllm") or r.server_urls:
        return f"not applicable: rollout.backend is {r.backend}" + (" with rollout.server_urls" if r.server_urls else "")
    key = f"rollout.{r.backend}_python"
    python = getattr(r, f"{r.backend}_python")
    problems = []
    if shutil.which(python) is None and not (os.path.isfile(python) and os.access(python, os.X_OK)):
        problems.append(f"{key}: {python!r} is not an executable; point it at the Python of the environment "
                        f"where {r.backend} is installed")
    else:
        try:
            version = engine_package_version(python, r.backend)
        except RuntimeError as e:
            problems.append(f"{key}: {e}")
        else:
            if version is None:
                problems.append(f"{key}: {r.backend} is not installed for {python!r} (pip install "
                                f"'{r.backend}=={ENGINE_PINS[r.backend]}*' in that environment, or point {key} at "
                                "the Python that has it)")
            elif not version.startswith(ENGINE_PINS[r.backend]):
                logger.warning("%s: %s %s is installed for %r; megatron-rl speaks the API of %s%s (answers that "
                               "differ fail with an error naming the version)", key, r.backend, version, python,
                               r.backend + " ", ENGINE_PINS[r.backend] + "x")
    if r.backend == "vllm" and cfg.weight_sync.backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            problems.append("rollout.backend=vllm with weight_sync.backend=nccl needs a CUDA GPU (vLLM's NCCL weight "
                            "transfer); on CPU run vLLM's CPU build with weight_sync.backend=gloo "
                            "(scripts/setup_vllm_cpu.sh), or rollout.backend=vllm-embedded, the embedded server in "
                            "vLLM's dialect")
    elif r.backend == "vllm" and not problems:  # gloo: megatron-rl's transfer engine must be in vLLM's environment
        try:
            plugin = engine_package_version(python, VLLM_GLOO_PLUGIN)
        except RuntimeError as e:
            problems.append(f"{key}: {e}")
        else:
            if plugin is None:
                problems.append(f"{key}: weight_sync.backend=gloo needs megatron-rl's gloo weight-transfer engine in "
                                f"vLLM's environment ({VLLM_GLOO_PLUGIN} is not installed for {python!r}: "
                                f"'{python} -m pip install plugins/vllm_gloo', or scripts/setup_vllm_cpu.sh)")
    if len(problems) == 1:
        raise RuntimeError(problems[0])
    if problems:
        raise RuntimeError(f"rollout.backend={r.backend}: {len(problems)} problems:\n  - " + "\n  - ".join(problems))
    return None


CHECKS: tuple[Check, ...] = (
    Check("world_size", "world size divisible by TP*PP*CP", world_size),
    Check("run_dir", "run_dir free of an earlier run's checkpoints when trainer.resume_mode is disable", run_dir),
    Check("data_parallel_split", "mini-batches split evenly over data-parallel ranks", data_parallel_split),
    Check("data_files", "data files exist", data_files),
    Check("transformer_impl", "Transformer Engine and CUDA for trainer.transformer_impl=transformer_engine",
          transformer_impl),
    Check("fp8", "Transformer Engine and a Hopper GPU for FP8", fp8),
    Check("sequence_parallel", "sequence-parallel norms (Transformer Engine's, else torch norms marked SP)",
          sequence_parallel),
    Check("model_files", "model.path holds a Hugging Face model", model_files),
    Check("rollout_servers", "rollout servers reachable (rollout.server_urls)", rollout_servers),
    Check("engine_environment", "the engines' Python (rollout.sglang_python / vllm_python) with the engine "
          "installed in it (sglang 0.5.x / vllm 0.33.x) and, for vLLM, a GPU (weight_sync nccl) or the gloo "
          "plugin (gloo)",
          engine_environment),
)
"""Every launch-time check, in the order `run_preflight` runs them."""

CHECK_NAMES = tuple(c.name for c in CHECKS)


def get_check(name: str) -> Check:
    """The check called `name`. Raises `KeyError` listing the valid names."""
    for c in CHECKS:
        if c.name == name:
            return c
    raise KeyError(f"unknown preflight check {name!r}; valid names: {', '.join(CHECK_NAMES)}")


def environment_checks(cfg: Config) -> dict[str, Callable[[], Optional[str]]]:
    """name -> the check bound to `cfg` (call it to run it), in run order."""
    return {c.name: (lambda c=c: c.run(cfg)) for c in CHECKS}


def run_preflight(cfg: Config, names: tuple[str, ...] | None = None) -> None:
    """Run the checks called `names` (default: all, in order), logging each; the first failure
    raises its `RuntimeError`."""
    for c in CHECKS if names is None else tuple(get_check(n) for n in names):
        skipped = c.run(cfg)
        logger.info("environment check %s: %s [%s]", f"skipped ({skipped})" if skipped else "passed",
                    c.description, c.name)
