"""DSV4 eager-prefill memory: a reserved sparse-prefill output pool, in-place Q norm/RoPE and
host-side bounds guards for the DSV4 compress planner (docs/dsv4_memory.md)."""
