"""Host memory as a budget: what the host has (`memory.py`), which kind of memory each weight lies in (`regions.py`,
`account.py`), where weights are in their safetensors files (`files.py`) and re-mapping them there (`remap.py`), the
plan a host budget makes (`budget.py`), the staging ring file-backed weights reach the device through
(`staging.py`), one pipeline's host side at run time (`keeper.py`), and loading a pipeline file-backed
(`loading.py`). Its modules are imported by name (this file imports nothing)."""
