"""Drawings made from the engine's own objects: pipeline timelines (`pipeline`), traced
collectives (`comm`), the throughput model's breakdown (`explain`) and the notebooks'
interactive widgets (`widgets`). matplotlib is imported only when a figure is drawn."""
