"""megatron-rl: RL post-training (GRPO, DAPO, DA3PO) on megatron-core with SGLang rollout servers."""

from setuptools import find_packages, setup

setup(
    name="megatron-rl",
    version="0.1.0",
    description="RL post-training (GRPO, DAPO, DA3PO) on megatron-core with SGLang-API rollout servers",
    packages=find_packages(include=["megatron_rl", "megatron_rl.*"]),
    python_requires=">=3.12",
    install_requires=[
        "torch==2.14.1",
        "megatron-core==0.19.2",
        "transformers==5.24.0",
        "tokenizers==0.23.3",
        "safetensors==0.8.0",
        "math-verify==0.9.0",
        "pyyaml==6.0.4",
        "tensorboard==2.21.0",
        "psutil==7.2.2",
        "pyarrow==26.0.1",
        "requests==2.34.2",
        "httpx==0.28.1",
        "fastapi==0.165.0",
        "uvicorn==0.54.0",
        "pydantic==2.14.4",
        "tqdm==4.70.1",
        "matplotlib==3.11.2",
    ],
    extras_require={
        "test": ["pytest==9.2.0", "pytest-timeout==2.4.0", "httpx==0.28.1"],
        "gpu": ["transformer-engine[pytorch]", "nvidia-ml-py==13.615.71"],
        "wandb": ["wandb"],
    },
    entry_points={"console_scripts": ["megatron-rl=megatron_rl.cli:main"]},
)
