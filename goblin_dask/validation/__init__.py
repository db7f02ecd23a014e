"""Verification of volunteers' results (Freivalds checks, replicas, validators, trust)."""
