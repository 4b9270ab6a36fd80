"""Where the spool delivers: a JSON-lines file, syslog (UDP, TCP, TLS), HTTP (webhook, Splunk HEC)."""
