"""The networks as pure functions over parameter pytrees: shared layers, the Qwen3 target, the
DSpark/DFlash drafter. Nothing here reads files or knows about training or serving."""
