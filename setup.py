"""Packaging entry point for megatron-lrmoe."""

from setuptools import find_packages, setup

setup(
    name="megatron-lrmoe",
    version="0.1.0",
    description=(
        "Megatron-Core plugin: quota-limited, compacted MoE backward (LRMoE) for "
        "expert-parallel training"
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_lrmoe", "megatron_lrmoe.*"]),
    # The planner's C source, compiled on first use (megatron_lrmoe/control/native.py).
    package_data={"megatron_lrmoe.control": ["_native.c"]},
    py_modules=["pretrain_lrmoe"],
    python_requires=">=3.12",
    install_requires=[
        "megatron-core==0.19.2",
        "torch>=2.11",
        "numpy",
        # megatron.core's torch_dist checkpoint writer imports psutil on every save.
        "psutil",
        # megatron.core imports triton unconditionally but does not declare it.
        "triton",
    ],
    extras_require={
        "test": ["pytest>=8", "matplotlib"],
        "demo": ["matplotlib"],
        "te": ["transformer-engine[pytorch]"],
        "apex": ["apex"],
    },
    entry_points={
        "console_scripts": [
            "lrmoe-demo=megatron_lrmoe.demo.main:main",
            "lrmoe-pretrain=pretrain_lrmoe:main",
        ]
    },
)
