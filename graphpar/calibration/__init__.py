"""The calibration wing: `graphpar calibrate` measures a machine (`measure`), profiles plans
inside their steps (`in_step`, `plan_runs`) and fits a cluster file (`calibrate`)."""
