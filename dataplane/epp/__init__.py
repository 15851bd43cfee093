"""kvroute as a Gateway API Inference Extension Endpoint Picker (``kvroute-epp``)."""
