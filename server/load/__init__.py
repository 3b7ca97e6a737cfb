"""Loading a checkpoint: its files read, laid out, dequantized and filled into segments, a generation built."""
