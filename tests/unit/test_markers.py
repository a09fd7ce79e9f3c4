"""The test-suite conventions of tests/conftest.py: layer markers from the folder, the gpu skip rule."""
from tests.conftest import LAYERS, gpu_skip_reason


def test_layer_marker_comes_from_the_folder(request):
    assert request.node.get_closest_marker("unit") is not None
    assert all(request.node.get_closest_marker(m) is None for m in LAYERS if m != "unit")


def test_gpu_skip_reason_names_the_requirement():
    assert "needs CUDA" in gpu_skip_reason(1, 0, False)
    assert "gpu(count=2)" in gpu_skip_reason(2, 1, True)
    assert gpu_skip_reason(1, 1, True) is None
    assert gpu_skip_reason(4, 8, True) is None
