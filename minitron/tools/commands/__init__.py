"""The `minitron` commands, one module per command or family: each builds its own
subparser (`add_parser`) next to the command it runs; `tools/cli.py` registers them.

`options` holds the flags the commands share (one per field of the config dataclasses) and
reads them back into `ModelConfig`, `ParallelConfig` and `TrainConfig`; `ranks` starts a
command's job on every rank and turns a rank's failure into one line.
"""
