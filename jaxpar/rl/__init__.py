"""Reinforcement learning on jaxpar's models: GRPO with the serving engine making the rollouts in the
training process (``jaxpar.rl.loop.run_grpo``; the objective and the batches: ``jaxpar.rl.grpo``)."""
