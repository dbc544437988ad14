"""Test support: synthetic checkpoints and the same layer through the plain Rust API.

Not a stable API.
"""

from ._kda import _input_copies as input_copies
from ._kda import _reference_forward as reference_forward
from ._kda import _write_synthetic_checkpoint as write_synthetic_checkpoint

__all__ = ["input_copies", "reference_forward", "write_synthetic_checkpoint"]
