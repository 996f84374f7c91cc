"""The maths on tensors: comparison verdicts, error and tensor statistics, the CPU reference, device math and timing."""
