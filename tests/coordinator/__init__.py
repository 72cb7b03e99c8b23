"""Tests of `actors/coordinator/`: the coordinator's operations, fan-out, restore plan and
fencing."""
