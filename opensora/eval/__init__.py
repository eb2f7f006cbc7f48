"""Evaluation metrics. ``opensora.eval.moving_shapes`` scores videos against MovingShapes captions."""
