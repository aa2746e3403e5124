"""megatron-rl: RL post-training (GRPO, DAPO, DA3PO) on megatron-core with SGLang rollout servers.

`install_requires` holds RANGES, so that `pip install megatron-rl` leaves a working torch (an NGC
container's, built with Transformer Engine and Apex) alone. The exact tested set is
`constraints.txt` (`pip install -c constraints.txt -e ".[test]"`, what scripts/setup.sh and .ci/run
install). Each floor, and why, is stated next to it.
"""

from setuptools import find_packages, setup

setup(
    name="megatron-rl",
    version="0.1.0",
    description="RL post-training (GRPO, DAPO, DA3PO) on megatron-core with SGLang-API rollout servers",
    # eval/data holds no Python: listed so setuptools installs it as package data without a warning
    packages=find_packages(include=["megatron_rl", "megatron_rl.*"]) + ["megatron_rl.eval.data"],
    # the benchmark files `megatron-rl eval --data NAME` reads (sources and licences: PROVENANCE.md)
    package_data={"megatron_rl.eval.data": ["*.jsonl", "PROVENANCE.md"]},
    include_package_data=True,
    python_requires=">=3.12",  # megatron-core 0.19 requires Python >= 3.12
    install_requires=[
        # >=2.6: megatron-core 0.19's own floor, and weight_sync/group.py passes `backend_options` to
        # the private `_new_process_group_helper` (renamed from `pg_options` in 2.6). The unit tier
        # passes on 2.6.0 and 2.14.1 (tests/install). No ceiling below 3: NGC containers carry
        # pre-release builds (e.g. 2.16.0a0+nv) that a `<2.15` would replace; parallel/cpu_compat.py and
        # weight_sync/group.py check the version at start (megatron_rl/compat.py) and warn above the
        # newest tested minor.
        "torch>=2.6.0,<3",
        # cpu_compat.py patches megatron-core internals of the 0.19 series and raises on another one
        "megatron-core>=0.19.0,<0.20",
        # >=4.56: the rollout server uses transformers.cache_utils.DynamicLayer and
        # DynamicCache(config=...) (the 4.56 cache refactor); tested with 5.24
        "transformers>=4.56,<6",
        # >=0.22: the Qwen2.5 tokenizer.json the tests use was written by tokenizers 0.22
        "tokenizers>=0.22",
        # >=0.4.3: safe_open/save_file as used here; transformers' own floor
        "safetensors>=0.4.3",
        # the hub-id resolver (models/hub.py): snapshot_download(local_files_only=, cache_dir=) and
        # huggingface_hub.errors.LocalEntryNotFoundError exist from 0.23; transformers pulls a newer one
        "huggingface_hub>=0.23",
        # math grading decides rewards: a verifier older than the tested one grades differently
        # (floor = the tested release); 1.0 may change parse/verify
        "math-verify>=0.9.0,<1",
        # the first releases with Python 3.12 wheels (our Python floor) for the compiled ones
        "numpy>=1.26",
        "pyyaml>=6.0.1",
        "pyarrow>=14",
        "psutil>=5.9.6",
        "matplotlib>=3.8",
        "tensorboard>=2.15",  # torch.utils.tensorboard's SummaryWriter; optional at run time
        # pydantic v2 API (ConfigDict, model_validate) in the rollout server
        "pydantic>=2.0,<3",
        "fastapi>=0.110",  # pydantic-v2-only FastAPI line
        "uvicorn>=0.29",
        "httpx>=0.27,<1",  # the 0.27/0.28 client API (no `proxies=`)
        "requests>=2.31",
        "tqdm>=4.66",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout>=2.3", "httpx>=0.27,<1"],
        "gpu": ["transformer-engine[pytorch]", "nvidia-ml-py>=12"],
        "wandb": ["wandb"],
    },
    entry_points={"console_scripts": ["megatron-rl=megatron_rl.cli:main"]},
)
