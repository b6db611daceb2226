"""One record of where a module is: every pipeline holding a component reads the book's entry for it, so that no
pipeline's `doe.offload_status` says a component is on the device while its own record, or its tensors, say it is
not, whichever pipeline moved it (issue 29, item 2)."""

import pytest

pytest.importorskip("diffusers_offload_ext", reason="plugin-only: the offload status")

import diffusers_offload_ext as doe  # noqa: E402
from diffusers_offload_ext.testing import tiny  # noqa: E402

pytestmark = [pytest.mark.plugin_only, pytest.mark.usefixtures("installed")]
NAME = "sd15"


def test_a_pipeline_sharing_components_sees_where_another_one_moved_them(accelerator):
    pipe = tiny.build(NAME)
    pipe.enable_model_cpu_offload(device="cpu", keep_on_device_between_generations=True)
    tiny.run(pipe, NAME)
    other = type(pipe).from_pipe(pipe)  # the same component objects
    other.enable_model_cpu_offload(device="cpu", keep_on_device_between_generations=True)
    other.remove_all_hooks()  # no longer armed: it takes no part in what moves now
    assert all(c.resident for c in doe.offload_status(other).components.values())
    assert doe.release(pipe) > 0  # the first pipeline sends them home
    for status in (doe.offload_status(pipe), doe.offload_status(other)):
        assert status.components and all(not c.resident and c.where == "host" for c in status.components.values())
