"""The rank program: a GPT decoder trained by DeepSpeed, instrumented for Vigil."""
