"""The torch dtypes a run can hold, under the names scenarios and the conformance kit use."""

from __future__ import annotations

import torch

# A scenario's ``precision`` -> the dtype of its parameters and compute.
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}
# torch's own names ("float32", "bfloat16"), as conformance cases and their JSON write them.
BY_TORCH_NAME = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16)}
# A floating dtype -> the integer dtype of its width: its bit patterns as integers.
BITS_OF = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
           torch.float16: torch.int16}
