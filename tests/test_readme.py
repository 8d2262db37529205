"""The README's self-contained Python examples run as written."""

import re
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(60)

README = Path(__file__).parents[1] / "README.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_quick_start_blocks_run_in_order() -> None:
    namespace: dict[str, object] = {}
    for index in (0, 1):  # the quick start, then the first examples (which reuse its imports)
        exec(compile(blocks()[index], f"README.md python block {index}", "exec"), namespace)
    grads = namespace["grads"]
    assert len(grads) == 2  # type: ignore[arg-type]
    np.testing.assert_allclose(grads[0], [0.1, 0.2], rtol=1e-6)  # type: ignore[index]
    np.testing.assert_allclose(grads[1], [0.3, 0.4, 0.5], rtol=1e-6)  # type: ignore[index]
    assert namespace["g0"].tolist() == [1.0] * 4  # type: ignore[attr-defined]
