"""The arithmetic of one step: AdamW's hyperparameters and kernel, the moment formats, the compiled update.

No I/O and no state directory here: functions over tensors and bytes. Internal.
"""
