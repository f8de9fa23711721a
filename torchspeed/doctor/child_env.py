"""The environment variables through which `launch` tells the bootstrap in the script's process what to
do (removed before the script runs); apart, so the parent names them without importing the child's side."""
from __future__ import annotations

ENV_OUT = "TORCHSPEED_DOCTOR_OUT"  # where the record goes (rank-suffixed under torchrun)
ENV_STEPS = "TORCHSPEED_DOCTOR_STEPS"
ENV_TRACE = "TORCHSPEED_DOCTOR_TRACE"
ENV_CPROFILE = "TORCHSPEED_DOCTOR_CPROFILE"
ENV_SEED = "TORCHSPEED_DOCTOR_SEED"  # --try: every run seeded alike, so losses compare
ENV_FIXES = "TORCHSPEED_DOCTOR_FIXES"  # --try: JSON {fix name: value} applied by the bootstrap
ENV_MEMORY = "TORCHSPEED_DOCTOR_MEMORY"  # "1": one step measured for where its memory goes
ENV_PROBE = "TORCHSPEED_DOCTOR_PROBE"  # --try's first run: "attention" measures the attention seen, after the steps
