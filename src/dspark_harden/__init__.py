"""dspark-harden: a fail-closed hardening plugin for stock SGLang 0.5.23 (DeepSeek V4 + DSpark, DP2)."""

__version__ = "0.1.0"
