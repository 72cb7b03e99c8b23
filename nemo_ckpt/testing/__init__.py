"""Test doubles that behave like the real thing: a reference data plane and its cut."""

from nemo_ckpt.testing.data_plane import StaticCut

__all__ = ["StaticCut"]
