"""The tools around the engine: the command line (`cli`, one module per command in
`commands/`), the verifier that compares a layout with one device (`verify`), measurement
(`measure`, `bench`, `sweep`), run reports (`report`, `tensorboard_log`), text generation
(`sampling`), the checks made before any rank starts (`preflight`, `output_paths`,
`resume_checks`, `check_ckpt`) and the helpers that start real ranks for tests (`testing`).
None of the engine imports these; they import the engine."""
