"""What the lessons compute and ask: graded questions (`quiz`), and the figures and
tables of each lesson built from the engine and its analysis (`collectives`, `figures`,
`ptdp`, `context_parallel`). The lab checkers live beside it in `minitron.labs`."""
