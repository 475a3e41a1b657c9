"""Shared test helpers: reference models built with transformers, and hand-driven deltaserve forward passes."""
