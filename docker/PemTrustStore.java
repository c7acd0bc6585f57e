// Build-time only: turns a PEM bundle (the build secret `ca`) into a PKCS#12 truststore for
// Maven's JVM, all certificates in one JVM start (keytool -importcert takes the first one only).
// Usage: java PemTrustStore.java BUNDLE.pem OUT.p12 PASSWORD
import java.io.FileInputStream;
import java.io.FileOutputStream;
import java.security.KeyStore;
import java.security.cert.Certificate;
import java.security.cert.CertificateFactory;

public class PemTrustStore {
    public static void main(String[] args) throws Exception {
        KeyStore store = KeyStore.getInstance("PKCS12");
        store.load(null, null);
        int n = 0;
        try (FileInputStream in = new FileInputStream(args[0])) {
            for (Certificate cert : CertificateFactory.getInstance("X.509").generateCertificates(in)) {
                store.setCertificateEntry("ca-" + n++, cert);
            }
        }
        try (FileOutputStream out = new FileOutputStream(args[1])) {
            store.store(out, args[2].toCharArray());
        }
        System.out.println(n + " certificates in " + args[1]);
    }
}
