"""Shared pytest configuration: value validation is on in every test process and rank."""

import os

# The documented switch (megatron_deepepv2.config): host-side checks plus cross-rank agreement on errors.
os.environ.setdefault("MEGATRON_DEEPEPV2_VALIDATE", "1")
