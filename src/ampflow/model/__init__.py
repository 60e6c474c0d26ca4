"""Plain nn.Modules and functions of the paired HiGLUE-style model; no process or device logic."""
