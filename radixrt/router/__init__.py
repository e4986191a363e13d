"""`radixrt router`: cache-aware routing in front of radixrt servers (see `app`)."""
