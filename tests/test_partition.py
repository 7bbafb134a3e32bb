"""The one row split against numpy's ``array_split`` (the convention it follows)."""

import numpy as np
import pytest

from dlrm.engine.partition import split_bounds, split_sizes


@pytest.mark.parametrize("n", [0, 1, 5, 7, 64, 1001])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
def test_split_equals_numpy_array_split(n, parts):
    expected = [len(chunk) for chunk in np.array_split(np.arange(n), parts)]
    assert split_sizes(n, parts) == expected
    bounds = split_bounds(n, parts)
    assert [bounds[r + 1] - bounds[r] for r in range(parts)] == expected
    assert bounds[0] == 0 and bounds[-1] == n


def test_a_split_into_no_parts_is_refused():
    with pytest.raises(ValueError, match="at least 1 part"):
        split_sizes(10, 0)
