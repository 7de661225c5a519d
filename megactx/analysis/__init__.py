"""Analytic cost models of a ModelConfig: FLOPs and KV-cache bytes per token."""
