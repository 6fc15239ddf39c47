"""The engine core: the step loop (schedule, launch, finish, update) and the step pipeline that decides what runs
ahead, the scheduler and its requests, beam search, grammars and the encoder cache's book; and the process that
runs it behind the API server."""
