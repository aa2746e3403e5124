"""Checkpoint conversion: Hugging Face safetensors <-> megatron-core distributed checkpoint, streaming.

- `import_from_hf`: an HF folder -> a model-only dist checkpoint (torch_dist format). The
  checkpoint stores global tensors (megatron-core's sharded state dict of a TP=1, PP=1 model), so
  it loads into any TP/PP layout: megatron-core reshards on load.
- `export_to_hf`: a run's checkpoint (or any dist checkpoint of this project's model layout) -> an
  HF folder that transformers, SGLang and vLLM load: safetensors in HF's default 5 GB shards (with
  `model.safetensors.index.json` when there are several), `config.json` / `generation_config.json`
  and the tokenizer files copied from the model folder.

Neither direction builds the model. The checkpoint's structure (keys, global shapes, chunk
offsets, the per-layer `_extra_state` objects and the common state) comes from megatron-core's
`sharded_state_dict` of a model built on the meta device, so it is exactly what `dist_checkpointing`
itself writes and loads. Tensors then move one at a time:

- import: megatron-core's `dist_checkpointing.save` runs with `_StreamingSaveStrategy`, which
  writes the plan through torch.distributed.checkpoint's `FileSystemWriter` one unit at a time
  (the embedding, each layer, the head), one `.distcp` file per unit; each chunk is built from
  its HF tensor(s) when the writer asks for it (`HFTensors` reads one tensor, the fused QKV needs
  q, k and v) and dropped after its unit's file is written.
- export: `dist_checkpointing.load` reads one unit's global tensors at a time; they are split
  into HF tensors and collected into safetensors shards of at most `max_shard_bytes`.

Mixture-of-Experts models (qwen3_moe, SequentialMLP experts) stack each layer's experts over a
second axis, the global expert index E: `decoder.layers.mlp.experts.experts.linear_fc1.weight`
[L, E_n, 2F, h] and `...linear_fc2.weight` [L, E_n, h, F], next to the router
`decoder.layers.mlp.router.weight` [L, E_n, h]. They map to HF's on-disk per-expert names
`model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight` and `model.layers.L.mlp.gate.weight`.
Every expert-parallel rank writes its experts at their global offsets, so a checkpoint written at
any EP size exports the same, and an imported one loads at any EP size.

Peak memory: import holds one unit (for Qwen2.5-32B a layer is ~1 GB in bf16, the embedding
1.6 GB) plus the HF tensors it is built from; export holds the pending output shard (flushed
before a unit that would not fit is read) or one unit with torch.distributed.checkpoint's read
buffers (about 3x the unit: file bytes, deserialised tensor, destination). A MoE layer unit holds
all of the layer's experts (Qwen3-30B-A3B: 128 experts, ~1.2 GB in bf16).
`benchmarks/convert_32b_2layer.py` measures both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from megatron_rl.models.hub import resolve_model_path

logger = logging.getLogger(__name__)

# Files of an HF model folder that are not weights and travel with a conversion.
HF_SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "tokenizer.model",
)
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3  # transformers' default max_shard_size "5GB"


@contextlib.contextmanager
def single_process_world() -> Iterator[None]:
    """A one-rank gloo world with megatron-core's parallel state, unless one is already up; the CPU
    compatibility layer is switched off again on exit if this turned it on."""
    from megatron_rl.parallel.cpu_compat import cpu_compat_enabled, disable_cpu_compat, enable_cpu_compat
    from megatron_rl.parallel.groups import world_of_one

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        yield
        return
    was_enabled = cpu_compat_enabled()
    enable_cpu_compat()
    try:
        with world_of_one(backend="gloo", timeout_s=600):
            yield
    finally:
        if not was_enabled:
            disable_cpu_compat()


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
        return Path(resolve_model_path(str(hf_dir), what="--hf-config-dir"))  # a hub id -> the HF cache
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


def _dtype_of(hf_config: dict, override: Optional[str]) -> torch.dtype:
    name = override or hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype {name!r}: expected one of {sorted(table)}")
    return table[name]


def _meta_sharded_state_dict(hf_config: dict, dtype: torch.dtype, vocab_multiple: int) -> dict:
    """megatron-core's sharded state dict of the whole model (TP=1, PP=1) on the meta device: the
    checkpoint's keys, global shapes, chunks and objects, without allocating a tensor.

    Args:
        vocab_multiple: the padded vocabulary is a multiple of this (make_vocab_size_divisible_by x TP).
    """
    from megatron_rl.checkpoint.save import _model_sharded_state_dict
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.hf_config import build_transformer_config

    tf_config = build_transformer_config(hf_config, params_dtype=dtype, bf16=dtype == torch.bfloat16)
    # meta tensors need megatron's CPU-initialisation path (it allocates without a device) and no init
    tf_config.use_cpu_initialization, tf_config.perform_initialization = True, False
    with torch.device("meta"):
        model = build_model(hf_config, tf_config, make_vocab_size_divisible_by=vocab_multiple, use_te=False)
    return _model_sharded_state_dict([model])


def _unit_of(key: str, offsets) -> str:
    """Conversion unit of a checkpoint tensor: `embedding`, `layer {L}` or `head`."""
    from megatron_rl.models.hf_weights import LAYERS_PREFIX

    if key.startswith(LAYERS_PREFIX):
        return f"layer {offsets[0]}"
    return "embedding" if key.startswith("embedding.") else "head"


def _unit_order(unit: str) -> tuple[int, int]:
    """Sort key of the units in HF order: embedding, layers, head."""
    if unit in ("embedding", "head"):
        return (0 if unit == "embedding" else 2, 0)
    return (1, int(unit.split()[1]))


def _model_tensor_keys(sharded: dict) -> list[str]:
    """The distinct tensor keys of a (meta) sharded state dict, in order, each checked to have an HF
    counterpart (ShardedTensorFactory keys included: a factory's tensors share its key).

    Raises:
        ValueError: a key the HF mapping does not know (names it; see `hf_weights.sharded_key_axes`).
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from megatron_rl.models.hf_weights import sharded_key_axes

    keys: dict[str, None] = {}
    for sh in nested_values(sharded):
        if isinstance(sh, (ShardedTensor, ShardedTensorFactory)) and sh.key not in keys:
            sharded_key_axes(sh.key)
            keys[sh.key] = None
    return list(keys)


def _progress(total_bytes: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled,
                dynamic_ncols=True)


# --------------------------------------------------------------------------- HF -> megatron


def _streaming_strategy(make_chunk: Callable[[str, tuple, tuple, torch.dtype], torch.Tensor], progress):
    """A megatron-core save strategy (torch_dist format) that writes one unit at a time.

    `dist_checkpointing.save` hands it the preprocessed sharded state dict (factories applied,
    common state added, integrity validated) and writes `metadata.json` after it returns. The
    plan and the checkpoint metadata are megatron-core's own (`MCoreSavePlanner`); only the data
    of a tensor chunk is produced late: `make_chunk(key, offsets, sizes, dtype)` when
    torch.distributed.checkpoint's `FileSystemWriter` reaches it.
    """
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import _StoragePrefix
    from torch.distributed.checkpoint.planner import WriteItemType

    class _LatePlanner(MCoreSavePlanner):
        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            chunk = write_item.tensor_data.chunk
            tensor = make_chunk(write_item.index.fqn, tuple(chunk.offsets), tuple(chunk.sizes),
                                write_item.tensor_data.properties.dtype)
            progress.update(tensor.numel() * tensor.element_size())
            return tensor

    class _StreamingSaveStrategy(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            planner = _LatePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
            planner.set_up_planner(mcore_to_pyt_state_dict(flat, False), None, True)
            global_plans, metadata = planner.create_global_plan([planner.create_local_plan()])
            plan = planner.finish_plan(global_plans[0])
            writer = FileSystemWriter(str(checkpoint_dir), single_file_per_rank=True, thread_count=1, overwrite=True)
            writer.set_up_storage_writer(True)
            progress.total = sum(torch.Size(it.tensor_data.chunk.sizes).numel() * it.tensor_data.properties.dtype.itemsize
                                 for it in plan.items if it.type != WriteItemType.BYTE_IO)
            progress.refresh()
            units: dict[str, list] = {"objects": []}  # bytes objects (tiny) share the first file
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    units["objects"].append(item)
                else:
                    units.setdefault(_unit_of(item.index.fqn, item.index.offset), []).append(item)
            units["embedding"] = units.pop("objects") + units.pop("embedding", [])
            results = []
            for i, (_, items) in enumerate(sorted(units.items(), key=lambda kv: _unit_order(kv[0]))):
                unit_plan = dataclasses.replace(plan, items=items, storage_data=_StoragePrefix(f"__{i}_"))
                results.append(writer.write_data(unit_plan, planner).wait())
            writer.finish(metadata, results)

    return _StreamingSaveStrategy()


def import_from_hf(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: Optional[str] = None,
                   tensor_model_parallel_size: int = 1, make_vocab_size_divisible_by: int = 128,
                   progress: bool = False) -> Path:
    """Write an HF model as a model-only megatron-core dist checkpoint, tensor by tensor.

    The torch_dist checkpoint holds global tensors, so any TP/PP layout loads it; only the
    padded vocabulary depends on the layout (Megatron-LM pads to a multiple of
    `make_vocab_size_divisible_by` x TP; case B29), so give the TP size the checkpoint is for.
    `out_dir` also receives a copy of the HF side files (config.json, tokenizer) under `hf/`, so
    that `export_to_hf(out_dir)` needs nothing else. `metadata.json` is written last: a
    conversion that dies leaves a folder no loader takes for a checkpoint.

    Args:
        hf_dir: HF model folder (config.json and *.safetensors, with or without an index).
        out_dir: an empty folder (created).
        dtype: float32 | bfloat16 | float16 of the stored tensors; default: config.json's dtype.
        tensor_model_parallel_size, make_vocab_size_divisible_by: the vocabulary padding.
        progress: show a tqdm progress bar (bytes written) on stderr.

    Returns:
        `out_dir`.

    Raises:
        FileNotFoundError: `hf_dir` has no config.json.
        FileExistsError: `out_dir` already holds a dist checkpoint.
        ValueError: an unsupported architecture, a model tensor without an HF counterpart (names
            its key), or weights that do not match config.json (names the tensor and both shapes),
            checked from the safetensors headers before writing.
    """
    from megatron.core import dist_checkpointing

    from megatron_rl.models.hf_config import build_transformer_config
    from megatron_rl.models.hf_weights import HFTensors, check_hf_checkpoint, global_chunk_from_hf

    src = Path(resolve_model_path(str(hf_dir), what="--hf"))  # a hub id (ORG/NAME[@REV]) -> the HF cache
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src}: no config.json (not a Hugging Face model folder)")
    hf_config = json.loads((src / "config.json").read_text())
    if tensor_model_parallel_size < 1 or make_vocab_size_divisible_by < 1:
        raise ValueError(f"tensor_model_parallel_size and make_vocab_size_divisible_by must be >= 1, got "
                         f"{tensor_model_parallel_size} and {make_vocab_size_divisible_by}")
    target = _dtype_of(hf_config, dtype)
    num_groups = build_transformer_config(hf_config).num_query_groups  # also rejects unsupported configs
    source = HFTensors(src)
    expected = check_hf_checkpoint(source, hf_config, str(src))
    out = Path(out_dir)
    if (out / "metadata.json").exists():
        raise FileExistsError(f"{out} already holds a dist checkpoint; choose an empty folder")
    out.mkdir(parents=True, exist_ok=True)
    total = sum(torch.Size(s).numel() for s in expected.values()) * target.itemsize

    def make_chunk(key: str, offsets: tuple, sizes: tuple, chunk_dtype: torch.dtype) -> torch.Tensor:
        chunk = global_chunk_from_hf(source, key, offsets, sizes, num_query_groups=num_groups)
        return chunk.to(chunk_dtype)

    with single_process_world(), _progress(total, "HF -> megatron", progress) as bar:
        sharded = _meta_sharded_state_dict(hf_config, target, make_vocab_size_divisible_by * tensor_model_parallel_size)
        _model_tensor_keys(sharded)  # every tensor has an HF mapping: refused by key before anything is written
        dist_checkpointing.save(sharded, str(out), sharded_strategy=_streaming_strategy(make_chunk, bar))
    hf_side = out / "hf"
    hf_side.mkdir(exist_ok=True)
    for name in HF_SIDE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, hf_side / name)
    logger.info("imported %s -> %s", src, out)
    return out


# --------------------------------------------------------------------------- megatron -> HF


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class _ShardWriter:
    """Writes tensors into `model-0000i-of-0000n.safetensors` files of at most `max_bytes` each
    (a tensor larger than that gets a shard of its own), then the index. Files are renamed once
    the shard count is known, as transformers names them. Holds at most one shard in memory."""

    def __init__(self, out_dir: Path, max_bytes: int) -> None:
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def reserve(self, nbytes: int) -> None:
        """Flush now when `nbytes` more would not fit the current shard: called before a unit is
        loaded, so that the pending shard and the unit's load buffers are never in memory together."""
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self.flush()

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
        os.chmod(tmp, 0o666 & ~_umask())  # safetensors creates files 0600; the folder's other files follow the umask
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


def _check_against_config(expected_sd: dict, saved: dict, ckpt: Path, vocab_size: int) -> None:
    """The checkpoint's global shapes against the config's (vocabulary rows: any padding >= V).

    Raises:
        ValueError: a missing tensor, or another shape (names the tensor and both shapes).
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(expected_sd)
    for sh in nested_values(expected_sd):
        if not isinstance(sh, ShardedTensor):
            continue
        other = saved.get(sh.key)
        want = tuple(sh.global_shape)
        if other is None:
            raise ValueError(f"checkpoint {ckpt} has no tensor {sh.key!r} (the config expects shape {list(want)}); "
                             "was it written for another architecture?")
        got = tuple(other.global_shape)
        vocab = sh.key in ("embedding.word_embeddings.weight", "output_layer.weight")
        if got != want and not (vocab and got[1:] == want[1:] and got[0] >= vocab_size):
            raise ValueError(f"checkpoint {ckpt}: tensor {sh.key!r} has shape {list(got)}, the model of "
                             f"config.json expects {list(want)}")


def _export_units(model_keys: list[str], saved: dict,
                  num_layers: int) -> list[tuple[str, list[tuple[str, Optional[int]]]]]:
    """(unit, [(key, layer or None)]) in HF order: embedding, layers, final norm, output layer.

    Args:
        model_keys: the model's tensor keys from the config (`_model_tensor_keys`; all in `saved`).
        saved: the checkpoint's tensors metadata (an output layer there is exported even when the
            config ties it: the tied check of `_export_units_to` needs it).
    """
    from megatron_rl.models.hf_weights import LAYERS_PREFIX

    layer_keys = [k for k in model_keys if k.startswith(LAYERS_PREFIX)]
    units = [("embedding", [("embedding.word_embeddings.weight", None)])]
    units += [(f"layer {i}", [(k, i) for k in layer_keys]) for i in range(num_layers)]
    units.append(("final norm", [("decoder.final_layernorm.weight", None)]))
    if "output_layer.weight" in saved:
        units.append(("output layer", [("output_layer.weight", None)]))
    return units


def export_to_hf(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, *, hf_config_dir: Optional[str] = None,
                 dtype: Optional[str] = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 progress: bool = False) -> Path:
    """Write the model of a megatron checkpoint as a Hugging Face folder, one layer at a time.

    Args:
        checkpoint: a run dir, `<run_dir>/checkpoints`, an `iter_NNNNNNN` folder, or a
            dist-checkpoint folder (see `resolve_checkpoint`); any TP/PP layout wrote it.
        out_dir: the HF folder to write (created; existing weight files in it are replaced).
        hf_config_dir: folder with the model's config.json and tokenizer; default: the `hf/`
            folder `import_from_hf` wrote, else the run's `model.path` from its config.yaml.
        dtype: float32 | bfloat16 | float16 for the saved tensors; default: config.json's dtype.
        max_shard_bytes: safetensors shard size (HF's default 5 GB).
        progress: show a tqdm progress bar (bytes written) on stderr.

    Returns:
        `out_dir`.

    Raises:
        FileNotFoundError: no checkpoint at `checkpoint`, or no config.json.
        ValueError: an unsupported architecture, a model tensor without an HF counterpart (names
            its key), checkpoint tensors that do not match the config (names the tensor and both
            shapes), or an HF tensor of the config that the checkpoint does not give.
    """
    from megatron_rl.models.hf_config import build_transformer_config
    from megatron_rl.models.hf_weights import expected_hf_shapes

    ckpt, iter_dir = resolve_checkpoint(checkpoint)
    src = _model_source_dir(ckpt, iter_dir, hf_config_dir)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src}: no config.json (pass --hf-config-dir)")
    hf_config = json.loads((src / "config.json").read_text())
    tf = build_transformer_config(hf_config)  # rejects unsupported architectures
    expected_hf = expected_hf_shapes(hf_config)
    target = _dtype_of(hf_config, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # shards go to a staging folder; weights already in `out` are replaced only once all are written
    stage = out / f".megatron-rl-export-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    try:
        files = _export_units_to(stage, ckpt, hf_config, tf, expected_hf, target, max_shard_bytes, progress)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    for old in list(out.glob("*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        old.unlink()
    for f in stage.iterdir():
        f.rename(out / f.name)
    stage.rmdir()
    for name in HF_SIDE_FILES:
        if (src / name).is_file() and (src / name).resolve() != (out / name).resolve():
            shutil.copy2(src / name, out / name)
    logger.info("exported %s -> %s (%d safetensors file(s))", ckpt, out, len(files))
    return out


def _tensor_digest(tensor: torch.Tensor) -> bytes:
    """SHA-1 of a tensor's bytes (dtype-exact)."""
    import hashlib

    return hashlib.sha1(tensor.detach().contiguous().view(torch.uint8).numpy()).digest()


def _export_units_to(out: Path, ckpt: Path, hf_config: dict, tf, expected_hf: dict, target: torch.dtype,
                     max_shard_bytes: int, progress: bool) -> list:
    """The unit-by-unit export loop of `export_to_hf`, writing shards into `out` (created)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_rl.models.hf_weights import hf_from_global

    out.mkdir(parents=True, exist_ok=True)
    tied = bool(hf_config.get("tie_word_embeddings", False))
    embed_digest = None
    writer = _ShardWriter(out, max_shard_bytes)
    total = sum(torch.Size(s).numel() for s in expected_hf.values()) * target.itemsize
    with single_process_world(), _progress(total, "megatron -> HF", progress) as bar:
        saved = dist_checkpointing.load_tensors_metadata(str(ckpt))
        vocab_size = expected_hf["model.embed_tokens.weight"][0]
        expected_sd = _meta_sharded_state_dict(hf_config, target, 1)
        model_keys = _model_tensor_keys(expected_sd)
        _check_against_config(expected_sd, saved, ckpt, vocab_size)
        written: set[str] = set()
        for _, keys in _export_units(model_keys, saved, tf.num_layers):
            request = {}
            for key, layer in keys:
                meta = saved[key]
                if layer is None:
                    request[key] = ShardedTensor.from_rank_offsets(key, torch.empty(meta.global_shape, dtype=meta.dtype))
                else:  # one layer of the stacked [num_layers, ...] tensor (experts: all of the layer's)
                    local = torch.empty((1, *meta.global_shape[1:]), dtype=meta.dtype)
                    request[key] = ShardedTensor.from_rank_offsets(key, local, (0, layer, meta.global_shape[0]))
            writer.reserve(sum(t.data.numel() for t in request.values()) * target.itemsize)
            with warnings.catch_warnings():  # torch DCP's notes on megatron-core's own calls, once per unit
                warnings.filterwarnings("ignore", message="The argument order of load has been changed")
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                # a partial load (one unit): the whole-checkpoint access check does not apply
                loaded = dist_checkpointing.load(request, str(ckpt), validate_access_integrity=False)
            named = []
            for key, layer in keys:
                tensor = loaded.pop(key)
                named += hf_from_global(key, tensor[0] if layer is not None else tensor, layer=layer,
                                        num_query_groups=tf.num_query_groups, head_dim=tf.kv_channels,
                                        vocab_size=vocab_size)
            order = {name: i for i, name in enumerate(expected_hf)}
            for name, tensor in sorted(named, key=lambda nt: order.get(nt[0], -1)):
                if name not in expected_hf:  # e.g. a tied model's output layer at PP > 1
                    if name == "lm_head.weight" and tied and _tensor_digest(tensor.to(target)) != embed_digest:
                        raise ValueError(
                            f"checkpoint {ckpt} has an output layer that differs from its embedding (untied), but "
                            "config.json says tie_word_embeddings=true: exporting would drop the trained lm_head; "
                            "pass --hf-config-dir with the untied config")
                    continue
                if name == "model.embed_tokens.weight" and tied:
                    embed_digest = _tensor_digest(tensor.to(target))
                if tuple(tensor.shape) != expected_hf[name]:
                    raise ValueError(f"checkpoint {ckpt}: HF tensor {name!r} comes out with shape {list(tensor.shape)}, "
                                     f"config.json expects {list(expected_hf[name])}")
                writer.add(name, tensor.to(target))
                written.add(name)
                bar.update(tensor.numel() * target.itemsize)
            del loaded, named
        missing = [name for name in expected_hf if name not in written]
        if missing:  # a safety net: every key of the config maps, so this means a mapping gap
            raise ValueError(f"checkpoint {ckpt}: {len(missing)} HF tensors of config.json were not produced, e.g. "
                             f"{missing[:4]}")
        return writer.close()
