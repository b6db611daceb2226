import re

from setuptools import find_packages, setup

with open("diffusers_offload_ext/__init__.py", encoding="utf-8") as f:
    VERSION = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)

#: What `diffusers-offload demo` needs beyond the requirements: its tiny pipelines have CLIP and T5 text encoders
#: (their tokenizers are built in memory: no sentencepiece or protobuf). Loading real checkpoints may need more.
DEMO = ["transformers>=4.51"]

setup(
    name="diffusers-offload-ext",
    version=VERSION,
    description="Controllable, cheap model CPU offload for HuggingFace diffusers pipelines.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["diffusers_offload_ext", "diffusers_offload_ext.*"]),
    package_data={
        "diffusers_offload_ext.models": [
            "data/specs/*.json",
            "data/recorded/*.json",
            "data/blocks.json",
            "data/activations.json",
        ]
    },
    python_requires=">=3.9",
    # Install torch first (on these machines `pip install torch==2.13.0`, a CPU build): the range below is then
    # satisfied and pip installs no other torch.
    install_requires=[
        "torch>=2.1",
        "diffusers>=0.32.2,<=0.42.1",
        "accelerate>=1.6.0,<=1.15.0",
        # `doe.trace(...)`'s table (rich) and timeline (matplotlib), and `diffusers-offload demo --png`. Imported
        # lazily: neither `import diffusers_offload_ext` nor the CLI's plan loads them.
        "rich>=13",
        "matplotlib>=3.7",
    ],
    extras_require={
        # `diffusers-offload demo` (plan and doctor need nothing extra).
        "demo": DEMO,
        # The test suite: the demo's needs, LoRA tests (peft), the runners and the formatter.
        "test": DEMO + ["peft", "pytest", "hypothesis", "black"],
    },
    entry_points={"console_scripts": ["diffusers-offload=diffusers_offload_ext.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: Apache Software License",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
