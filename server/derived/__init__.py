"""Derived tensors made for readers (casts and gathers): asked, checked, made, counted against a quota."""
