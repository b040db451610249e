"""Building blocks of the generic decoder: norm, rotary, attention, MoE routing."""
