"""Checkpoint conversion: Hugging Face safetensors <-> megatron-core distributed checkpoint.

- `export_to_hf`: a run's checkpoint (or any megatron-core dist checkpoint of this project's
  layout) -> an HF folder that transformers, SGLang and vLLM load: sharded safetensors (HF's
  default 5 GB shards, with `model.safetensors.index.json` when there are several), the model's
  `config.json` / `generation_config.json` and the tokenizer files copied from the run's model.
  Tensors are written shard by shard as the weight generator yields them, so memory holds the
  model plus at most one shard.
- `import_from_hf`: an HF folder -> a model-only dist checkpoint. The torch_dist format stores
  global tensors, so the result loads into any TP/PP layout (megatron-core reshards on load).

Both run in one process (world size 1, gloo on CPU) and build the whole model in memory, which
fits models that fit one host's RAM; the streaming converter for checkpoints larger than memory
(tensor by tensor, without building the model) is not done yet.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Iterator, Optional

import torch

logger = logging.getLogger(__name__)

# Files of an HF model folder that are not weights and travel with an export.
HF_SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "tokenizer.model",
)
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3  # transformers' default max_shard_size "5GB"


@contextlib.contextmanager
def single_process_world() -> Iterator[None]:
    """A one-rank gloo world with megatron-core's parallel state, unless one is already up."""
    from megatron_rl.parallel.cpu_compat import enable_cpu_compat
    from megatron_rl.parallel.groups import world_of_one

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        yield
        return
    enable_cpu_compat()
    with world_of_one(backend="gloo", timeout_s=600):
        yield


def resolve_checkpoint(path: str | os.PathLike) -> tuple[Path, Optional[Path]]:
    """(the dist-checkpoint folder with `metadata.json`, the iteration folder or None).

    Accepts a run dir (its latest complete checkpoint), `<run_dir>/checkpoints`, an
    `iter_NNNNNNN` folder, or a dist-checkpoint folder itself.

    Raises:
        FileNotFoundError: nothing loadable there (says what was looked for).
    """
    from megatron_rl.checkpoint.save import checkpoint_dir, latest_checkpoint

    p = Path(path)
    if (p / "metadata.json").is_file():
        return p, (p.parent if (p.parent / "run_state.json").is_file() else None)
    if (p / "model_optim" / "metadata.json").is_file():
        return p / "model_optim", p
    run_dir = p.parent if p.name == "checkpoints" else p
    step = latest_checkpoint(run_dir)
    if step is not None:
        it = checkpoint_dir(run_dir, step)
        return it / "model_optim", it
    raise FileNotFoundError(
        f"{p}: no megatron checkpoint found (looked for metadata.json, model_optim/metadata.json and "
        f"checkpoints/latest_checkpointed_iteration.txt)"
    )


def _model_source_dir(ckpt: Path, iter_dir: Optional[Path], hf_dir: Optional[str]) -> Path:
    """The HF folder that holds config.json and the tokenizer for an export."""
    if hf_dir is not None:
        return Path(hf_dir)
    if (ckpt / "hf" / "config.json").is_file():  # written by import_from_hf
        return ckpt / "hf"
    if iter_dir is not None and (iter_dir / "config.yaml").is_file():
        import yaml

        cfg = yaml.safe_load((iter_dir / "config.yaml").read_text()) or {}
        model = cfg.get("model") or {}
        path = model.get("hf_config_path") and Path(model["hf_config_path"]).parent or model.get("path")
        if path:
            return Path(path)
    raise ValueError("cannot tell which HF config the checkpoint was trained from: pass --hf-config-dir "
                     "(a folder with the model's config.json and tokenizer)")


def _build(hf_config: dict, dtype: torch.dtype):
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.hf_config import build_transformer_config

    tf_config = build_transformer_config(hf_config, params_dtype=dtype, bf16=dtype == torch.bfloat16)
    return build_model(hf_config, tf_config)


def _dtype_of(hf_config: dict, override: Optional[str]) -> torch.dtype:
    name = override or hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype {name!r}: expected one of {sorted(table)}")
    return table[name]


class _ShardWriter:
    """Writes tensors into `model-0000i-of-0000n.safetensors` files of at most `max_bytes` each
    (a tensor larger than that gets a shard of its own), then the index. Files are renamed once
    the shard count is known, as transformers names them."""

    def __init__(self, out_dir: Path, max_bytes: int) -> None:
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        tmp = self.out_dir / f".shard-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(tmp), metadata={"format": "pt"})
        self.files.append((tmp, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[Path]:
        self.flush()
        n = len(self.files)
        if n == 1:
            final = self.out_dir / "model.safetensors"
            os.replace(self.files[0][0], final)
            return [final]
        weight_map, out = {}, []
        for i, (tmp, names) in enumerate(self.files, start=1):
            final = self.out_dir / f"model-{i:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, final)
            out.append(final)
            weight_map.update({name: final.name for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return out


def export_to_hf(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, *, hf_config_dir: Optional[str] = None,
                 dtype: Optional[str] = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write the model of a megatron checkpoint as a Hugging Face folder.

    Args:
        checkpoint: a run dir, `<run_dir>/checkpoints`, an `iter_NNNNNNN` folder, or a
            dist-checkpoint folder (see `resolve_checkpoint`).
        out_dir: the HF folder to write (created; existing weight files in it are replaced).
        hf_config_dir: folder with the model's config.json and tokenizer; default: the run's
            `model.path` from the checkpoint's config.yaml.
        dtype: float32 | bfloat16 | float16 for the saved tensors; default: config.json's dtype.
        max_shard_bytes: safetensors shard size (HF's default 5 GB).

    Returns:
        `out_dir`.

    Raises:
        FileNotFoundError: no checkpoint at `checkpoint`.
        ValueError: the checkpoint's tensors do not match the config (names the tensor and both shapes).
    """
    from megatron.core import dist_checkpointing

    from megatron_rl.checkpoint.save import _check_shapes, _model_sharded_state_dict
    from megatron_rl.models.hf_weights import iter_hf_weights

    ckpt, iter_dir = resolve_checkpoint(checkpoint)
    src = _model_source_dir(ckpt, iter_dir, hf_config_dir)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src}: no config.json (pass --hf-config-dir)")
    hf_config = json.loads((src / "config.json").read_text())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        old.unlink()
    saved = dist_checkpointing.load_tensors_metadata(str(ckpt))
    emb = next((v for k, v in saved.items() if k.endswith("embedding.word_embeddings.weight")), None)
    stored = emb.dtype if emb is not None else torch.float32
    with single_process_world():
        model = _build(hf_config, stored)
        sharded = _model_sharded_state_dict([model])
        _check_shapes(sharded, ckpt)
        loaded = dist_checkpointing.load(sharded, str(ckpt))
        model.load_state_dict(loaded["model"], strict=True)
        target = _dtype_of(hf_config, dtype)
        writer = _ShardWriter(out, max_shard_bytes)
        with torch.no_grad():
            for name, tensor in iter_hf_weights(model, hf_config):
                writer.add(name, tensor.to(target))
        files = writer.close()
    for name in HF_SIDE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    logger.info("exported %s -> %s (%d safetensors file(s), %.1f MB)", ckpt, out, len(files), writer.total_bytes / 1e6)
    return out


def import_from_hf(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: Optional[str] = None) -> Path:
    """Write an HF model as a model-only megatron-core dist checkpoint (torch_dist, global tensors:
    it loads into any TP/PP layout). `out_dir` receives the dist checkpoint and a copy of the HF
    side files (config.json, tokenizer) so that `export_to_hf(out_dir)` needs nothing else.

    Raises:
        FileNotFoundError: `hf_dir` has no config.json.
        ValueError: the weights do not match the config (see `load_hf_weights`).
    """
    from megatron.core import dist_checkpointing

    from megatron_rl.checkpoint.save import _in_process_results_queue, _model_sharded_state_dict
    from megatron_rl.models.hf_weights import load_hf_weights

    src = Path(hf_dir)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src}: no config.json (not a Hugging Face model folder)")
    hf_config = json.loads((src / "config.json").read_text())
    out = Path(out_dir)
    if (out / "metadata.json").exists():
        raise FileExistsError(f"{out} already holds a dist checkpoint; choose an empty folder")
    out.mkdir(parents=True, exist_ok=True)
    with single_process_world():
        model = _build(hf_config, _dtype_of(hf_config, dtype))
        with torch.no_grad():
            load_hf_weights(model, src)
        _in_process_results_queue()
        dist_checkpointing.save(_model_sharded_state_dict([model]), str(out))
    hf_side = out / "hf"
    hf_side.mkdir(exist_ok=True)
    for name in HF_SIDE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, hf_side / name)
    logger.info("imported %s -> %s", src, out)
    return out
