"""For each diffusers pipeline test named in a file (pytest ids, one per line, as `FAILED tests/...::Class::test` or
`tests/...::Class::test`), build the test's dummy pipeline and call it once without any offloading, as the offload
tests do before enabling it. A failure here is the environment's (missing stand-ins, packages), not offloading's.

    cd DIFFUSERS_TREE && HF_HOME=... HF_HUB_OFFLINE=1 python tools/run_without_offload.py FAILED_IDS.txt
"""

import importlib
import sys

import numpy as np
import torch


def verdict(module: str, name: str) -> str:
    cls = getattr(importlib.import_module(module), name)
    test = cls()
    try:
        pipe = cls.pipeline_class(**test.get_dummy_components())
        for component in pipe.components.values():
            if hasattr(component, "set_default_attn_processor"):
                component.set_default_attn_processor()
        torch.manual_seed(0)
        output = pipe(**test.get_dummy_inputs("cpu"))[0]
        array = output.cpu().float().numpy() if torch.is_tensor(output) else np.asarray(output, dtype=np.float32)
        return "NaN without offloading" if np.isnan(array).any() else "runs without offloading"
    except Exception as error:  # the first line of whatever the environment raised
        return f"fails without offloading: {type(error).__name__}: {str(error).splitlines()[0][:100]}"


def main(path: str) -> int:
    sys.path.insert(0, ".")
    with open(path, encoding="utf-8") as f:
        ids = [line.split()[-1].split(" - ")[0] for line in f if "::" in line]
    for test_id in ids:
        file, name = test_id.split("::")[:2]
        print(f"{name} | {verdict(file[:-3].replace('/', '.'), name)}", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: run_without_offload.py FAILED_IDS.txt")
    sys.exit(main(sys.argv[1]))
