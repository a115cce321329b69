"""Debugging aids on the top floor (they may use the driver, the API and every backend; nothing
below imports them). `fusec.debug.bisect`: check one megakernel step op by op against the
registry references."""
