"""The nemotron-nas (DeciLM) checkpoint layout for sublayer cuts: config conversion and the code it ships with."""
