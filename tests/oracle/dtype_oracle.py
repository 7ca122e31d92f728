#!/usr/bin/python3
"""Rounds float32 values to bfloat16 and float16 with PyTorch (Debian python3-torch) and prints
the resulting bit patterns, the reference for Tandem's conversions.

usage: dtype_oracle.py FILE   (FILE: little-endian float32 values)
prints {"bf16": [bits...], "f16": [bits...]}
"""
import json
import sys

import numpy as np
import torch

values = torch.from_numpy(np.fromfile(sys.argv[1], dtype="<f4").copy())
bf16 = values.to(torch.bfloat16).view(torch.int16).numpy().astype(np.uint16)
f16 = values.to(torch.float16).view(torch.int16).numpy().astype(np.uint16)
json.dump({"bf16": bf16.tolist(), "f16": f16.tolist()}, sys.stdout)
