"""The one prepared GPU check (device_check) and what the lent machine needs carried to it
(device_wheels.sh)."""
