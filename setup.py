from setuptools import find_packages, setup

setup(
    name="diffusers-offload-ext",
    version="0.1.0",
    description="Controllable, cheap model CPU offload for HuggingFace diffusers pipelines.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["diffusers_offload_ext", "diffusers_offload_ext.*"]),
    package_data={"diffusers_offload_ext": ["configs/*.json"]},
    python_requires=">=3.9",
    # Install torch first (on these machines `pip install torch==2.13.0`, a CPU build): the range below is then
    # satisfied and pip installs no other torch.
    install_requires=[
        "torch>=2.1",
        "diffusers>=0.32.2,<=0.42.1",
        "accelerate>=1.6.0,<=1.15.0",
        # The `diffusers-offload` command (plan/demo/doctor) and `doe.trace(...)`'s table and timeline. Imported
        # lazily: `import diffusers_offload_ext` does not load them.
        "rich>=13",
        "matplotlib>=3.7",
    ],
    extras_require={
        "test": [
            "transformers>=4.51",
            "sentencepiece",
            "peft",
            "protobuf",
            "pytest",
            "hypothesis",
            "black",
        ],
        "report": ["rich", "matplotlib"],
    },
    entry_points={"console_scripts": ["diffusers-offload=diffusers_offload_ext.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: Apache Software License",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
