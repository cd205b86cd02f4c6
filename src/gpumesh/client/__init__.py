"""Caller side: GPUMesh, decorators, routing."""
