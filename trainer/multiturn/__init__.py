"""Multi-turn, tool-using rollouts: tools, environments, and the engine wrapper that runs trajectories.

`tools` (a tool's name, JSON schema and Python function; parsing Qwen-style `<tool_call>` JSON out of a model
turn), `environment` (what a trajectory starts from and what the model sees after each of its turns), and
`rollout` (`MultiTurnEngine`: any rollout engine made to generate whole trajectories, with a mask over the
tokens the model did not write). The recipe turns it on with `rollout.env`.
"""
