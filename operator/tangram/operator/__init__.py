"""The kopf operator: ActionPool, TrajectoryEnv and RewardService handlers (issue #5).

Handlers stay thin; what the cluster should hold is computed by the pure builders in
:mod:`tangram.operator.builders`.
"""
